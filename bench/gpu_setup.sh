# Sourced by the bench/gpu_*.sh device scripts: install the carried wheels (.whl/), set the import path, and write
# the device's name to $1/device.txt. Usage: source bench/gpu_setup.sh DIR
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$1/device.txt"
