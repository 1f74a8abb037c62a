"""`specdec make-tiny`: write a tiny random checkpoint in the exact Hugging Face layout."""
import argparse
import json


def add_parser(sub) -> None:
    from specdec_tools.tiny_presets import PRESETS
    p = sub.add_parser("make-tiny", help="write a random checkpoint in the Hugging Face layout",
                       description="Write a random checkpoint (config.json, safetensors, mtp.* weights, optional "
                                   "tokenizer) in the exact Hugging Face layout, deterministic from --seed.")
    p.add_argument("out_dir", help="folder to write (created)")
    p.add_argument("--family", default=None, choices=["qwen3_5", "qwen3_5_moe", "qwen3_next"],
                   help="default: the preset's (qwen3-next-80b-a3b: qwen3_next), else qwen3_5")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layout", default="text", choices=["text", "multimodal"],
                   help="text: model.layers.* (qwen3_5_text); multimodal: model.language_model.* as released")
    p.add_argument("--expert-layout", default="per_expert", choices=["per_expert", "fused"])
    p.add_argument("--mtp-layers", type=int, default=1, help="MTP decoder layers (0: no mtp.* tensors)")
    p.add_argument("--tokenizer", action="store_true", help="also train and save a byte-level BPE tokenizer")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: the linears in Qwen's FP8 format (float8_e4m3fn weights with 128 x 128 block scales)")
    p.add_argument("--config-only", action="store_true",
                   help="write config.json (and --tokenizer) but no weights: for --load-format dummy (the "
                        "qwen3-next-80b-a3b preset's weights are 160 GB)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=JSON",
                   help="override a text-config field, e.g. --set vocab_size=101 --set full_attention_interval=2")
    p.set_defaults(run=run)


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected FIELD=JSON")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            out[field] = value
    return out


def run(args: argparse.Namespace) -> int:
    from specdec_tools.tiny import make_tiny
    kwargs = dict(family=args.family, preset=args.preset, seed=args.seed, layout=args.layout,
                  mtp_layers=args.mtp_layers, tokenizer=args.tokenizer, overrides=parse_overrides(args.overrides),
                  expert_layout=args.expert_layout, weights=not args.config_only, quantization=args.quantization)
    if args.dtype:
        kwargs["dtype"] = args.dtype
    path = make_tiny(args.out_dir, **kwargs)
    from specdec_tools.tiny_presets import PRESET_FAMILIES
    family = args.family or PRESET_FAMILIES.get(args.preset, "qwen3_5")
    fp8 = " (FP8 linears)" if args.quantization == "fp8" and not args.config_only else ""
    print(f"wrote {family}/{args.preset} {'config' if args.config_only else 'checkpoint'}{fp8} to {path}")
    return 0
