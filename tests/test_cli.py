"""The `lwm-jax` console script: every subcommand is wired and bad usage is a one-line error."""
import subprocess
import sys

import pytest

from lwm_jax.cli import build_parser, main

SUBCOMMANDS = ("train", "prepare", "convert", "export", "generate", "eval", "precision-report")


def test_every_subcommand_is_wired():
    parser = build_parser()
    for name in SUBCOMMANDS:
        args = {"train": [name], "prepare": [name, "--input", "x", "--output", "y"],
                "convert": [name, "--input", "a", "--output", "b"],
                "export": [name, "--input", "a", "--output", "b", "--format", "hf"],
                "generate": [name, "--checkpoint", "c", "--prompt", "hi"],
                "eval": [name, "--checkpoint", "c"],
                "precision-report": [name, "--policy", "bf16-mixed"]}[name]
        ns = parser.parse_args(args)
        assert ns.command == name and callable(ns.func)


def test_missing_checkpoint_is_one_line_error(tmp_path, capsys):
    status = main(["eval", "--checkpoint", str(tmp_path / "nope"), "--data", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "nope" in err[0]


def test_console_script_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "lwm_jax.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("argv", [["export", "--output", "b", "--format", "hf"],
                                  ["convert", "--input", "a"]])
def test_missing_required_flag_exits_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_light_argument_module_matches_the_implementations():
    from lwm_jax.cli import args as cli_args
    from lwm_jax.interop import api
    assert cli_args.FORMATS == api.FORMATS and cli_args.EXPORT_FORMATS == api.EXPORT_FORMATS


def test_sigterm_before_training_starts_is_one_line_and_143():
    """SIGTERM while a command is still importing JAX or loading its input used to kill the
    process silently (status -15)."""
    import subprocess
    import sys
    code = ("import os, signal, time\n"
            "import lwm_jax.cli as cli\n"
            "import lwm_jax.train.cli as train_cli\n"
            "def slow(args):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n"
            "train_cli.train_main = slow\n"
            "import sys; sys.exit(cli.main(['train', '--print-config']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 143, (run.returncode, run.stderr)
    assert run.stderr.strip() == "lwm-jax train: stopped by SIGTERM"


def test_config_fifo_is_not_a_regular_file(tmp_path, capsys):
    import os
    os.mkfifo(tmp_path / "c.yaml")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a regular file (a FIFO" in err[0] and "c.yaml" in err[0]
