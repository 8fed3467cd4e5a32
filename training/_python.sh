#!/usr/bin/env bash
# Sourced by the scripts in training/: `qerl_python ROOT` sets PYTHON to an interpreter that has qerl's
# dependencies, so that a fresh clone works right after `bash setup_env.sh` without activating anything:
#   1. $PYTHON, when set;
#   2. the project's venv, $QERL_VENV (default ROOT/.venv, as setup_env.sh makes it), when it exists;
#   3. python3 / python on PATH, if it can import torch and trl (a conda env, an activated venv);
# otherwise one line on stderr saying how to make the venv, and exit status 2.
qerl_python() {
    local root=$1 venv=${QERL_VENV:-.venv} candidate
    [[ $venv == /* ]] || venv="$root/$venv"
    if [[ -n ${PYTHON:-} ]]; then
        return 0
    fi
    if [[ -x $venv/bin/python ]]; then
        PYTHON="$venv/bin/python"
        return 0
    fi
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch, trl" >/dev/null 2>&1; then
            PYTHON=$candidate
            return 0
        fi
    done
    echo "error: no Python with qerl's dependencies: run 'bash setup_env.sh' in $root (it makes $venv), or set PYTHON" >&2
    exit 2
}
