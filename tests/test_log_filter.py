"""No ``causal_conv1d`` or ``flash-linear-attention`` install advice on CPU commands (hf_openjev.log_filter): the
fallback is expected there."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from hf_openjev.log_filter import _DropKernelInstallAdvice

ADVICE = ("`causal_conv1d_fn` is falling back to its reference PyTorch implementation because `causal_conv1d` is not "
          "installed. This is correct but much slower; install `causal_conv1d` for the optimized kernel.")


def test_a_cpu_run_prints_no_causal_conv_advice(tiny_checkpoint):
    code = ("import hf_openjev\nfrom transformers import pipeline\n"
            f"jev = pipeline('jev-decision', model={str(tiny_checkpoint.export)!r}, device='cpu', dtype='float32')\n"
            "print(jev({'state': 's', 'questions': {'q': {'type': 'noul', 'instructions': 'i'}}})['answers']['q']"
            "['type'])\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "noul"  # a forward ran: the note fires on the first conv forward
    assert "causal_conv1d" not in out.stderr, out.stderr


def test_the_filter_drops_those_notes_only(tiny_model):
    drop = _DropKernelInstallAdvice()

    def record(message):
        return logging.LogRecord("transformers.integrations.hub_kernels", logging.WARNING, __file__, 1, message,
                                 None, None)

    assert not drop.filter(record(ADVICE))
    assert not drop.filter(record(ADVICE.replace("causal_conv1d", "flash-linear-attention")))
    assert drop.filter(record(ADVICE.replace("causal_conv1d", "causal_conv2d")))
    assert drop.filter(record("some other warning"))
    hub = logging.getLogger("transformers.integrations.hub_kernels")  # installed by the loaders, once
    assert sum(isinstance(f, _DropKernelInstallAdvice) for f in hub.filters) == 1
