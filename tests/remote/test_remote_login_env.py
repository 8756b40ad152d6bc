"""Through a real sshd on 127.0.0.1 whose SetEnv plays a GPU host's login environment: a remote launch starts from
what a hand launch over ssh gets (unless --clean-env), records that login environment beside what the server got,
and fingerprints the weights on the host, so weights changed behind the same path show in replay and diff."""

from eyas.cli import main
from eyas.ledger.ledger import Ledger
from tests.launch.conftest import run_id_of, write_config
from tests.remote.sshd import LOGIN_ENV


def eyas(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _launch(capsys, config, sshd, tmp_path, *extra):
    code, out, err = eyas(capsys, "launch", config, "--host", "root@127.0.0.1", *sshd.options(), "--remote-dir",
                          str(tmp_path / "remote"), *extra)
    assert code == 0, err
    with Ledger() as ledger:
        return ledger.get(run_id_of(out))


def test_login_environment_reaches_the_server_unless_clean_and_weights_are_fingerprinted_there(
        sshd, tmp_path, capsys, tiny):
    model = tmp_path / "model"  # a copy: the test changes its contents behind the same path
    model.mkdir()
    for f in tiny.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    config = write_config(tmp_path / "r.toml", model=str(model), env={"NCCL_PROTO": "LL"})

    inherited = _launch(capsys, config, sshd, tmp_path)
    assert inherited.status == "ok" and inherited.workers
    assert all(w.env[k] == v for w in inherited.workers for k, v in LOGIN_ENV.items())
    login = inherited.config["launch"]["login_env"]
    assert {k: login[k] for k in LOGIN_ENV} == LOGIN_ENV and inherited.config["launch"]["clean_env"] is False
    assert inherited.env["NCCL_SOCKET_IFNAME"] == "lo"  # what each process should get includes the login's
    assert len(inherited.model_fingerprint) == 64  # computed on the host, over ssh

    clean = _launch(capsys, config, sshd, tmp_path, "--clean-env")
    assert clean.status == "ok" and clean.config["launch"]["clean_env"] is True
    assert not any(k in w.env for w in clean.workers for k in LOGIN_ENV)
    assert all(w.env["NCCL_PROTO"] == "LL" for w in clean.workers)
    assert {k: clean.config["launch"]["login_env"][k] for k in LOGIN_ENV} == LOGIN_ENV  # recorded all the same
    assert clean.model_fingerprint == inherited.model_fingerprint

    code, out, _ = eyas(capsys, "runs", "diff", inherited.run_id, clean.run_id)
    causes = out.split("most plausible explanations, in order:\n")[1].split("\n\n")[0]
    assert code == 0 and "[workers] NCCL_IB_DISABLE: 1 x" in causes and "-> unset x" in causes
    assert "in B's login environment, not in its workers" in causes
    assert "\nlogin environment (" in out  # both runs' login environments, side by side

    (model / "notes.txt").write_text("retrained\n")  # new contents behind the same path
    code, out, err = eyas(capsys, "runs", "replay", clean.run_id, "--threshold", "5")
    assert code == 0, out + err
    assert f"note: the model at {model} changed since run {clean.run_id}" in out
    with Ledger() as ledger:
        again = ledger.list(limit=1)[0]
    assert again.config["launch"]["replay_of"] == clean.run_id and again.config["launch"]["clean_env"] is True
    code, out, _ = eyas(capsys, "runs", "diff", clean.run_id, again.run_id)
    assert "[weights] model contents" in out and "same path, different contents" in out
