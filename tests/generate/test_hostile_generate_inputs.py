"""Hostile generate inputs: FIFOs, undecodable prompt bytes, odd state metadata -> one line."""
import argparse
import os
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from lwm_jax.generate.cli import _read_prompt
from lwm_jax.generate.state_io import FORMAT, _counts, load_state_file
from generate_common import CFG


def _unblock_later(fifo):
    """Open `fifo` for writing after a while, so a reader that blocked on it (the bug) gets EOF
    and the test fails instead of hanging."""
    def run():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    t = threading.Timer(5, run)
    t.daemon = True
    t.start()


def test_prompt_file_fifo_and_non_utf8_prompt_are_one_line(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _unblock_later(fifo)
    ns = argparse.Namespace(prompt=None, prompt_file=str(fifo), load_state=None)
    with pytest.raises(ValueError, match=r"^--prompt-file: '.*fifo' is not a regular file \(a FIFO"):
        _read_prompt(ns)
    bad = os.fsdecode(b"caf\xff")          # what Python makes of a non-UTF-8 argv byte
    with pytest.raises(ValueError, match=r"^--prompt: contains a byte that is not UTF-8"):
        _read_prompt(argparse.Namespace(prompt=bad, prompt_file=None, load_state=None))


def test_state_file_fifo_and_non_ascii_digits_are_one_line(tmp_path):
    os.mkfifo(tmp_path / "s.safetensors")
    with pytest.raises(ValueError, match=r"s\.safetensors.*not a regular file \(a FIFO"):
        load_state_file(tmp_path / "s.safetensors", CFG)
    path = tmp_path / "m.safetensors"
    save_file({"x": np.zeros(1, np.float32)}, str(path),
              metadata={"format": FORMAT, "n_layer": "\u00b2", "n_embd": "1", "head_size": "1"})
    with pytest.raises(ValueError, match=r"m\.safetensors.*metadata n_layer='\u00b2' is not a number"):
        load_state_file(path, CFG)
    assert _counts("\u00b2", 1) == [] and _counts("7", 1) == [7]
