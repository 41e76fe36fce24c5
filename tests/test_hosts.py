"""Hosts against the real things: subprocesses here, a real sshd (root, a zsh user, a second host in a
network namespace), real bash/zsh/dash for quoting, real Prefect blocks for settings and secrets."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tasks.errors import CommandTimedOut, HostKeyRefused, HostUnreachable, LoginRefused, is_transient
from tasks.host import HostParams, LocalHost, open_host
from tasks.host.ssh import SSHHost, fingerprint, remote_command
from tests.fixtures.sshd import make_key
from tests.remote_steps import HERE as PROBES

# Everything a shell could act on: separators, substitutions, quotes, globs, blanks, an option.
EVIL = ["; rm -rf x", "$(touch pwned)", "`touch pwned2`", "it's \"quoted\"", "a  b\tc", "*", "~", "$HOME",
        "", "-n", "two\nlines", "&& touch pwned3 #", "héllo wörld",
        # what zsh expands beyond bash and dash: `=cmd` (its path), `==`, `k==cmd` (magic_equal_subst),
        # `^x` (extended_glob), `''` (rc_quotes); and history `!`, comments, globs, tildes, options
        "=sh", "==", "=", "k==sh", "--opt==sh", "~root", "~/x", "x=~", "-", "--", "-rf", "!!", "a!b", "!$",
        "^x", "x^y", "#c", "a#b", "*.py", "[ab]", "?", "**/*", "{a,b}", "x*(N)", "a''b", "'", "\\", "\n",
        "ends with newline\n", "\nstarts with newline", "tab\there", "%1", "+x", "a:b,c@d"]


@pytest.fixture
def host(each_host):
    """Each test on both kinds (LocalHost, SSHHost as root), with the echo script in its root."""
    each_host.put(PROBES / "echo_argv.py", each_host.path("echo_argv.py"))
    return each_host


def _alive(host, pid: int) -> bool:
    """The process runs (a zombie has ended: it only waits to be reaped). Read over SFTP: no shell."""
    try:
        stat = host.read_text(f"/proc/{pid}/stat")
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _echo(host, args, **kw) -> list[str]:
    r = host.run([host.python, host.path("echo_argv.py"), *args], **kw)
    assert r.exit_code == 0, r.stderr_tail
    return json.loads(r.stdout_tail[-1])


# Each shell as a login shell may run it, with the options a user's start-up files commonly set.
SHELLS = ["bash", "bash -O extglob -O globstar -o histexpand", "dash", "sh", "zsh",
          "zsh -o extendedglob -o magicequalsubst -o rcquotes -o globsubst"]


@pytest.mark.parametrize("shell", SHELLS)
def test_remote_command_keeps_every_word_in_each_shell(shell, tmp_path):
    """The command line SSHHost sends, run by a real bash, zsh and dash, as sshd would run it."""
    cwd = tmp_path / "a dir with spaces"
    (cwd / "x").mkdir(parents=True)
    (cwd / "a.py").write_text("")  # something for a glob to match
    env = {"EAGLET_X": "v $(touch pwned4)", "EAGLET_Z": "=sh", "EAGLET_T": "~"}
    line = remote_command(["python3", str(PROBES / "echo_argv.py"), *EVIL], cwd=str(cwd), env=env)
    out = subprocess.run([*shell.split(), "-c", line], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == EVIL
    assert (cwd / "x").is_dir() and not any(cwd.glob("pwned*"))
    printed = subprocess.run([*shell.split(), "-c", remote_command(["env"], env=env)], capture_output=True, text=True)
    assert {f"{k}={v}" for k, v in env.items()} <= set(printed.stdout.splitlines())


def test_remote_command_refuses_what_it_cannot_quote():
    with pytest.raises(ValueError, match="shell identifiers"):
        remote_command(["true"], env={"A B": "1"})
    with pytest.raises(ValueError, match="non-empty list"):
        remote_command("rm -rf /")
    with pytest.raises(ValueError, match="shell identifiers"):
        HostParams(env={"X;Y": "1"})
    with pytest.raises(ValueError, match="NUL"):
        remote_command(["echo", "a\0b"])


def test_arguments_reach_the_program_unchanged_and_run_nothing(host):
    host.makedirs(host.path("canary", "x"))
    assert _echo(host, EVIL, cwd=host.path("canary")) == EVIL
    assert host.exists(host.path("canary", "x"))
    assert not any(host.exists(host.path("canary", f"pwned{i}")) for i in ("", "2", "3"))


def test_lines_stream_as_written_and_a_timeout_ends_the_process_tree(host):
    pid_file = host.path("hang.pid")
    arrivals = []
    started = time.monotonic()
    with pytest.raises(CommandTimedOut, match="ran past 3"):
        host.run([host.python, host.path("echo_argv.py"), "--hang", pid_file], timeout=3,
                 on_line=lambda stream, line: arrivals.append((stream, line, time.monotonic() - started)))
    ended = time.monotonic() - started
    assert [a[:2] for a in arrivals] == [("stdout", "hanging")]
    assert arrivals[0][2] < ended - 1.0, "the line came only when the command ended, not as written"
    assert 3 <= ended < 3 + 5  # ended by TERM, well before the KILL grace ran out
    pids = [int(p) for p in host.read_text(pid_file).split()]
    deadline = time.monotonic() + 3
    while any(_alive(host, p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(host, p)], "the command or its child outlived the timeout"


def test_a_failing_command_returns_its_exit_code_and_stderr(host):
    r = host.run(["ls", host.path("no such file")])
    assert r.exit_code == 2 and "No such file" in r.stderr_tail[-1] and r.seconds > 0
    assert host.run(["no-such-program-eaglet"]).exit_code == 127


def test_files_go_and_come_back(host, tmp_path):
    src = tmp_path / "src"
    (src / "sub dir").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub dir" / "b.bin").write_bytes(bytes(range(256)) * 4)
    sent = host.bytes_sent
    assert host.put_dir(src, host.path("tree")) == 6 + 1024
    assert host.bytes_sent - sent == 6 + 1024
    received = host.bytes_received
    assert host.get_dir(host.path("tree"), tmp_path / "back") == 6 + 1024
    assert host.bytes_received - received == 6 + 1024
    assert (tmp_path / "back" / "sub dir" / "b.bin").read_bytes() == (src / "sub dir" / "b.bin").read_bytes()
    host.makedirs(host.path("deep", "er", "est"))
    host.write_text(host.path("deep", "er", "est", "t.json"), '{"k": "ü"}')
    assert json.loads(host.read_text(host.path("deep", "er", "est", "t.json"))) == {"k": "ü"}
    assert host.exists(host.path("deep")) and not host.exists(host.path("nope"))
    with pytest.raises(FileNotFoundError):  # the same on both kinds: make the folder first
        host.put(src / "a.txt", host.path("missing folder", "a.txt"))


# ----------------------------------------------------------------------------- ssh only
@pytest.mark.ssh
def test_unknown_host_key_is_refused_unless_trusted(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    with pytest.raises(HostKeyRefused) as e:
        open_host(sshd.params(known_hosts=str(known))).connect()
    msg = str(e.value)
    host_key = _public_key(sshd.host_key)
    for part in ("unknown", sshd.listen, str(sshd.port), fingerprint(host_key), "trust_unknown_host_key", "ssh-keyscan"):
        assert part in msg
    assert not is_transient(e.value) and not known.exists()

    with open_host(sshd.params(known_hosts=str(known), trust_unknown_host_key=True)) as h:
        assert h.run(["true"]).exit_code == 0
    assert sshd.host_key.split()[1] in known.read_text()  # recorded ...
    with open_host(sshd.params(known_hosts=str(known))) as h:  # ... so the strict default now connects
        h.connect()


@pytest.mark.ssh
def test_changed_host_key_is_refused_even_when_trusting(sshd, tmp_path):
    other = make_key(tmp_path / "other_host_key")
    known = tmp_path / "known_hosts"
    known.write_text(sshd.known_hosts_entry(other))
    for trust in (False, True):
        with pytest.raises(HostKeyRefused) as e:
            open_host(sshd.params(known_hosts=str(known), trust_unknown_host_key=trust)).connect()
        msg = str(e.value)
        assert "CHANGED" in msg and "ssh-keygen -R" in msg
        assert fingerprint(_public_key(other)) in msg and fingerprint(_public_key(sshd.host_key)) in msg
    assert known.read_text() == sshd.known_hosts_entry(other)  # nothing was overwritten


@pytest.mark.ssh
@pytest.mark.parametrize("shell", ["bash", "zsh", "dash"])
def test_the_printed_host_key_commands_work_with_odd_paths(sshd, tmp_path, shell):
    """The fix each message prints, pasted into a shell as it is, with a known_hosts path a shell would split."""
    known = tmp_path / "keys of $USER's" / "known hosts *"
    known.parent.mkdir()
    entry = f"[{sshd.listen}]:{sshd.port}"
    with pytest.raises(HostKeyRefused) as e:
        open_host(sshd.params(known_hosts=str(known))).connect()
    assert str(e.value).startswith(f"known_hosts: host key of {entry} is unknown:") and "(port" not in str(e.value)
    subprocess.run([shell, "-c", _printed_command(e.value, "ssh-keyscan")], check=True, timeout=30)
    with open_host(sshd.params(known_hosts=str(known))) as h:  # the scanned key is trusted now
        h.connect()

    known.write_text(sshd.known_hosts_entry(make_key(tmp_path / "other_host_key")))
    with pytest.raises(HostKeyRefused) as e:
        open_host(sshd.params(known_hosts=str(known))).connect()
    assert str(e.value).startswith(f"known_hosts: host key of {entry} CHANGED:")
    subprocess.run([shell, "-c", _printed_command(e.value, "ssh-keygen -R")], check=True, capture_output=True, timeout=30)
    assert sshd.listen not in known.read_text()  # the old key is gone


def _printed_command(error: Exception, start: str) -> str:
    return next(c for c in str(error).split("`")[1::2] if c.startswith(start))


@pytest.mark.ssh
def test_login_and_connection_faults_are_told_apart(sshd, tmp_path):
    make_key(tmp_path / "stranger")
    with pytest.raises(LoginRefused) as e:
        open_host(sshd.params(key_filename=str(tmp_path / "stranger"))).connect()
    assert not is_transient(e.value)
    with pytest.raises(HostUnreachable) as e:  # nothing listens there: refused at once
        open_host(sshd.params(port=_closed_port())).connect()
    assert is_transient(e.value)


@pytest.mark.ssh
def test_a_zsh_user_in_a_root_with_a_space(sshd, zsh_user):
    params = sshd.params(user=zsh_user.name, root=zsh_user.root, python="/usr/bin/python3")
    with open_host(params) as h:
        assert " " in h.root
        assert h.run(["printenv", "SHELL"]).stdout_tail == ["/usr/bin/zsh"]  # sshd ran our line in zsh
        assert h.run(["id", "-un"]).stdout_tail == [zsh_user.name]
        h.put(PROBES / "echo_argv.py", h.path("echo_argv.py"))
        h.makedirs(h.path("canary", "x"))
        assert _echo(h, EVIL, cwd=h.path("canary"), env={"EAGLET_Y": "$(touch pwned)"}) == EVIL
        assert h.exists(h.path("canary", "x")) and not h.exists(h.path("canary", "pwned"))


@pytest.mark.ssh
def test_a_second_host_in_its_own_network_namespace(netns_sshd):
    assert netns_sshd.port == 22 and netns_sshd.listen.startswith("10.200.")
    with open_host(netns_sshd.params(root=str(netns_sshd.dir / "root"))) as h:
        assert h.name == netns_sshd.listen
        client_ip, _, server_ip, server_port = h.run(["printenv", "SSH_CONNECTION"]).stdout_tail[0].split()
        assert (server_ip, server_port) == (netns_sshd.listen, "22") and client_ip != "127.0.0.1"


@pytest.mark.ssh
def test_host_settings_from_a_block_and_the_key_from_secret_blocks(sshd, prefect_harness, tmp_path):
    from prefect.blocks.system import Secret

    from tasks.errors import BadInputError

    key = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret pass", "-f", str(key)], check=True)
    sshd.authorize(" ".join(Path(f"{key}.pub").read_text().split()[:2]))
    Secret(value=key.read_text()).save("eaglet-test-key", overwrite=True)
    Secret(value="s3cret pass").save("eaglet-test-pass", overwrite=True)
    params = sshd.params(key_filename=None, key_secret="eaglet-test-key", passphrase_secret="eaglet-test-pass")
    params.save_block("eaglet-test-host")
    loaded = HostParams.from_block("eaglet-test-host")
    assert loaded == params and "s3cret" not in loaded.model_dump_json()
    with open_host(loaded) as h:
        assert isinstance(h, SSHHost) and h.run(["true"]).exit_code == 0
    with pytest.raises(LoginRefused, match="passphrase_secret"):
        open_host(params.model_copy(update={"passphrase_secret": None})).connect()
    with pytest.raises(BadInputError, match="no-such-block"):
        HostParams.from_block("no-such-block")


def _damaged(key_text: str):
    """The ways a pasted key arrives broken: the body cut short (footer kept or lost), a character changed."""
    head, *body_lines, foot = key_text.strip().splitlines()
    body = "".join(body_lines)
    for cut in range(0, len(body), 4):
        yield f"{head}\n{body[:cut]}\n{foot}\n"
        yield f"{head}\n{body[:cut]}\n"
    for i in range(0, len(body), 7):
        yield f"{head}\n{body[:i]}{'A' if body[i] != 'A' else 'B'}{body[i + 1:]}\n{foot}\n"


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa"])
def test_a_damaged_key_is_bad_input_naming_its_block(kind, tmp_path):
    """paramiko fails on some truncations with IndexError (and AssertionError, ValueError...)."""
    from tasks.errors import BadInputError
    from tasks.host.ssh import _parse_private_key

    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(tmp_path / "k")], check=True)
    for text in _damaged((tmp_path / "k").read_text()):
        try:
            _parse_private_key(text, None, "gpu1-key")
        except BadInputError as e:
            assert "Secret block 'gpu1-key'" in str(e) and "truncated" in str(e) and not is_transient(e)


@pytest.mark.ssh
def test_a_truncated_key_in_a_secret_block_fails_at_connect_naming_the_block(sshd, prefect_harness, tmp_path):
    from prefect.blocks.system import Secret

    from tasks.errors import BadInputError

    head, *body, foot = sshd.client_key.read_text().strip().splitlines()
    Secret(value=f"{head}\n{''.join(body)[:48]}\n{foot}\n").save("eaglet-test-cut-key", overwrite=True)
    with pytest.raises(BadInputError, match="Secret block 'eaglet-test-cut-key'.*truncated") as e:
        open_host(sshd.params(key_filename=None, key_secret="eaglet-test-cut-key")).connect()
    assert not is_transient(e.value)


def test_local_defaults():
    h = open_host(HostParams())
    assert isinstance(h, LocalHost) and h.name == "local" and Path(h.root).is_absolute()
    assert h.python and Path(h.python).exists()


def _public_key(line: str):
    import base64

    import paramiko

    kind, b64 = line.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(b64))


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
