"""Holes in the default approval policy: writes to paths made of variables, writes into a
repository's ``.git``, git pointed at another repository, and abbreviated or bundled options that
make a program run another one. Each form is put to the same ``decide`` the kernel's checker uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentloop.process.approval import decide, default_policy
from agentloop.process.approval.policy import Policy, Rule

CWD = "/home/u/proj"
HOME = "/home/u"


def _shell(command: str, cwd: str = CWD) -> str:
    return decide(default_policy(), "shell.exec", {"command": command}, cwd=cwd, home=HOME).action


# 1. a write whose target is not spelled out: its path is never known here
VARIABLE_WRITES = [
    "echo x > $HOME/.bashrc",
    "echo x >> ${HOME}/.profile",
    'echo x > "$(pwd)/../x"',
    "echo x > `echo ~`/.bashrc",
    "for f in *.txt; do echo x > $f; done",
    "ls &> $LOG",
    "git diff --output=$F",
    "git log --output $F",
]

# 2. writes into a repository's .git (config and hooks name what a later ``git status`` runs)
GIT_DIR_WRITES = [
    "echo '[core] fsmonitor = evil' >> .git/config",
    "cp evil .git/hooks/pre-commit",
    "mv x .git/hooks/post-checkout",
    "tee .git/config < x",
    "echo x > .GIT/config",
    "echo x > .gi?/config",
    "echo 'gitdir: /tmp/evil' > sub/.git",
    "sed -i s/a/b/ .git/config",
    "dd if=x of=.git/config",
    "ln -s .git g",
    "printf x > ./a/../.git/info/attributes",
    "cd .git && echo x > config",
    "pushd .git/hooks; cp ../../evil pre-commit",
]

# ... and git pointed at a repository elsewhere, whose configuration nobody here wrote or read
GIT_ELSEWHERE = [
    "git -C /tmp/evil status",
    "git -C sub -C ../.. status",
    "git --git-dir=/tmp/evil status",
    "git --git-dir /tmp/evil log",
    "git --git-dir=$X status",
    "git --work-tree=/ status",
    "git --bare log",
    "GIT_DIR=/tmp/evil git status",
    "HOME=/tmp/evil git status",
    "XDG_CONFIG_HOME=/tmp/evil git status",
    "export GIT_DIR=/tmp/evil; git status",
    "git init --template=/tmp/evil",
    "git -c core.sshCommand=id fetch",
    "git -c core.fsmonitor=id status",
    "git --config-env=core.fsmonitor=X status",
]

# 3. abbreviated, bundled or otherwise missed options that run a program or write a file
RUNNING_OPTIONS = [
    "sed --e='1e id' q",
    "sed --exp '1e id' q",
    "sed --fi=x.sed f.txt",
    "sed -nf x.sed f.txt",
    "sed --in s/a/b/ /etc/hosts",
    "awk -F : 'BEGIN{system(\"id\")}' f",
    "gawk -l evil.so 'BEGIN{}'",
    "gawk -i evil.awk 'BEGIN{}'",
    "gawk -E evil.awk",
    "awk --file=x.awk f",
    "mawk -W exec x.awk",
    "awk '@load \"x\"; BEGIN{}'",
    "env --split='rm -rf x'",
    "env --sp='rm x'",
    "env -iS 'rm x'",
    "tar --to-c=id -xf a.tar",
    "tar -xf a.tar --checkpoint=1 --checkpoint-a=exec=id",
    "tar --use-comp=id -cf a.tar x",
    "tar --rmt-command=id -xf a.tar",
    "tar -xf a.tar --dir=/etc",
    "sort --compress-p=id f",
    "sort --outp=/etc/passwd f",
    "sort -ro/etc/passwd f",
    "man --pag=id ls",
    "man -aPid ls",
    "man -C evil.conf ls",
    "less --lesskey-s=x f",
    "less --lesskey-f=x f",
    "less -Sk x f",
    "less '+!id' f",
    "LESSKEYIN=x less f",
    "fd -Hx rm",
    "fd --exec=rm",
    "fd -xrm",
    "zip --unzip-c=id a.zip f",
]

PLAIN = [
    "echo x > notes.txt",
    "echo x >> build/log.txt",
    "git status",
    "git -C sub status",
    "git log --oneline -5",
    "cat README.md",
    "cat < README.md",
    "echo x > .gitignore",
    "cp a .github/workflows/ci.yml",
    "awk -F, '{print $1}' f.csv",
    "awk -v x=1 '{print x}' f",
    "sed 's/a/b/' f.txt",
    "sed -i.bak s/a/b/ f.txt",
    "tar -xf a.tar --checkpoint=10",
    "sort -r f",
    "man ls",
    "less -S f",
    "fd -e py",
]


@pytest.mark.parametrize("command", VARIABLE_WRITES + GIT_DIR_WRITES + GIT_ELSEWHERE + RUNNING_OPTIONS)
def test_asked(command: str) -> None:
    assert _shell(command) == "ask", command


@pytest.mark.parametrize("command", PLAIN)
def test_plain_forms_stay_auto(command: str) -> None:
    assert _shell(command) == "auto", command


def test_a_variable_write_is_unclassified() -> None:
    decision = decide(default_policy(), "shell.exec", {"command": "echo x > $HOME/.bashrc"}, cwd=CWD, home=HOME)
    assert "unclassified" in decision.tags and "mutating" in decision.tags


def test_a_read_of_a_variable_path_is_unclassified_too() -> None:
    assert _shell("cat < $X") == "ask"


@pytest.mark.parametrize(
    ("syscall", "path"),
    [
        ("fs.write", ".git/config"),
        ("fs.write", ".git/hooks/pre-commit"),
        ("fs.edit", ".git/config"),
        ("fs.write", "sub/.git"),
        ("fs.write", "vendor/lib/.git/config"),
        ("fs.write", "$x/../.git/config"),
        ("fs.write", ".Git/HOOKS/post-checkout"),
    ],
)
def test_file_tools_writing_into_git_are_asked(syscall: str, path: str) -> None:
    args = {"path": path, "content": "x"} if syscall == "fs.write" else {"path": path, "old": "a", "new": "b"}
    decision = decide(default_policy(), syscall, args, cwd=CWD, home=HOME)
    assert decision.action == "ask", path
    assert "unclassified" in decision.tags


@pytest.mark.parametrize("path", ["notes.txt", ".gitignore", ".github/workflows/ci.yml", "src/git/config"])
def test_file_tools_elsewhere_stay_auto(path: str) -> None:
    decision = decide(default_policy(), "fs.write", {"path": path, "content": "x"}, cwd=CWD, home=HOME)
    assert decision.action == "auto", path
    assert decide(default_policy(), "fs.read", {"path": ".git/config"}, cwd=CWD, home=HOME).action == "auto"


def test_a_rule_of_the_policy_still_decides_a_git_write() -> None:
    trusting = Policy(default="auto", rules=(Rule(match="fs.write", action="auto"),))
    decision = decide(trusting, "fs.write", {"path": ".git/config", "content": "x"}, cwd=CWD, home=HOME)
    assert decision.action == "auto"
    # and a policy that denies by default still denies
    deny = Policy(default="deny")
    assert decide(deny, "fs.write", {"path": ".git/config", "content": "x"}, cwd=CWD, home=HOME).action == "deny"


def test_a_write_through_a_link_into_git_is_asked(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    os.symlink(".git", tmp_path / "g")
    ws = str(tmp_path)
    assert _shell("echo x > g/config", cwd=ws) == "ask"
    args = {"path": "g/hooks/pre-commit", "content": "x"}
    assert decide(default_policy(), "fs.write", args, cwd=ws, home=HOME).action == "ask"
    assert _shell("echo x > notes.txt", cwd=ws) == "auto"
