"""``UserError`` is one class for every package: what the item tokenizer raises (``recsvc_base.errors``) is the
``recsvc.errors.UserError`` the CLI turns into exit 2 and the service into INVALID_ARGUMENT."""

from __future__ import annotations

from cli_commands import only_commands

from recsvc.cli.main import main
from recsvc.errors import InvalidRequest, UserError


def test_one_user_error_for_every_package() -> None:
    import recsvc_base.errors
    import tokenizer_rqvae.ids

    assert UserError is recsvc_base.errors.UserError is tokenizer_rqvae.ids.UserError
    assert issubclass(InvalidRequest, UserError)


def test_the_tokenizer_command_exits_2_with_its_message(tmp_path, monkeypatch, capsys) -> None:
    only_commands(monkeypatch, "tokenizer")
    code = main(["tokenizer", "build", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "ids")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data directory not found") and "Traceback" not in err
