#!/usr/bin/env bash
# Sourced by the training scripts: how `-m qerl.train` is started on one GPU or data-parallel on several.
#   qerl_launcher GPUS PORT [PYTHON]   sets the array `launcher` to the command prefix before qerl.train's flags:
#     GPUS = 1: PYTHON -m qerl.train
#     GPUS > 1: PYTHON -m accelerate.commands.launch --config_file training/accelerate/ddp.yaml --num_processes GPUS
#               --main_process_port PORT -m qerl.train   (DDP, one process per GPU; see ddp.yaml)
#   qerl_per_device_batch BATCH GPUS [NAME]   prints BATCH / GPUS, or fails in one line if GPUS does not divide BATCH:
#     the per-step batch (prompts x generations) stays the same on 1 and N GPUs, each GPU taking its share.

qerl_launcher() {
    local gpus=$1 port=$2 python=${3:-python}
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    if (( gpus > 1 )); then
        launcher=("$python" -m accelerate.commands.launch --config_file "$root/training/accelerate/ddp.yaml"
                  --num_processes "$gpus" --main_process_port "$port" -m qerl.train)
    else
        launcher=("$python" -m qerl.train)
    fi
}

qerl_per_device_batch() {
    local batch=$1 gpus=$2 name=${3:---num-gpus}
    if ! [[ $gpus =~ ^[1-9][0-9]*$ ]]; then
        echo "error: $name: expected a positive integer, got '$gpus'" >&2
        return 2
    fi
    if (( batch % gpus )); then
        echo "error: $name $gpus: must divide the per-step batch of $batch completions (each GPU takes an equal share)" >&2
        return 2
    fi
    echo $(( batch / gpus ))
}
