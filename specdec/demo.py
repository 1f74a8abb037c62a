"""The embedded default model: a small Qwen3.5-architecture model with a trained MTP head, shipped in the
package (see `specdec train-demo` and the model card in the folder)."""
from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo_model"


def demo_model_dir() -> str:
    if not (DEMO_DIR / "config.json").is_file():
        raise FileNotFoundError(f"no --model given and the demo model is not installed at {DEMO_DIR}")
    return str(DEMO_DIR)
