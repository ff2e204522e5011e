"""Approval policy: parsing, rule resolution, per-call tags and decisions."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentloop.process.approval import (
    KNOWN_TAGS,
    NON_INTERACTIVE,
    Policy,
    Rule,
    args_fingerprint,
    call_tags,
    decide,
    default_policy,
    find_rule,
    parse_policy,
    remember_rule,
)

CWD = "/home/ann/proj"
HOME = "/home/ann"


def tags(syscall: str, args: dict[str, Any], target: str = "local") -> set[str]:
    return call_tags(syscall, args, target=target, cwd=CWD, home=HOME)


def policy(rules: list[dict[str, Any]], default: str = "auto") -> Policy:
    parsed, warnings = parse_policy({"default": default, "rules": rules})
    assert warnings == []
    return parsed


def winner(p: Policy, syscall: str, args: dict[str, Any] | None = None, *, target: str = "local") -> int | None:
    args = args or {}
    found = find_rule(p, syscall, args, frozenset(tags(syscall, args, target)), target)
    return None if found is None else found[0]


# -- parsing -------------------------------------------------------------------------------------


def test_parse_full_policy_with_aliases_and_roundtrip() -> None:
    text = json.dumps(
        {
            "default": "ask",
            "rules": [
                {"match": "fs.*", "target": "local", "action": "auto"},
                {
                    "match": "shell.exec",
                    "when": {"anyTag": ["network"], "argPrefix": {"command": "git "}, "argEquals": {"cwd": "."}},
                    "action": "deny",
                },
            ],
        }
    )
    parsed, warnings = parse_policy(text)
    assert warnings == []
    assert parsed.default == "ask"
    assert parsed.rules[1].when is not None and parsed.rules[1].when.any_tags == ("network",)
    assert parse_policy(json.dumps(parsed.to_json())) == (parsed, [])
    assert parse_policy(text.encode()) == (parsed, [])


@pytest.mark.parametrize("data", [None, "", "   \n"])
def test_nothing_written_is_the_default_without_warning(data: str | None) -> None:
    assert parse_policy(data) == (default_policy(), [])


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ('{"default": "auto", "rules": [', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, not list"),
        ({"default": "maybe"}, "default"),
        ({"rules": [{"match": "fs.read", "action": "allow"}]}, "rules.0.action"),
        ({"rules": [{"match": "fs.read", "action": "auto", "colour": "red"}]}, "rules.0.colour"),
        ({"rules": [], "extra": 1}, "extra"),
        ({"rules": [{"match": "fs.re*d", "action": "auto"}]}, "match"),
        ({"rules": [{"match": "fs.read", "target": "dev*", "action": "auto"}]}, "target"),
        ({"rules": [{"match": "shell.exec", "when": {"anyTag": ["netwrok"]}, "action": "ask"}]}, "netwrok"),
        ({"rules": [{"match": "shell.exec", "when": {"anyTag": []}, "action": "ask"}]}, "anyTag"),
        ({"rules": [{"action": "ask"}]}, "match"),
        ({"rules": "all"}, "rules"),
    ],
)
def test_bad_policy_gives_default_and_a_warning_naming_the_problem(data: Any, named: str) -> None:
    parsed, warnings = parse_policy(data)
    assert parsed == default_policy()
    assert warnings
    assert any(named in w for w in warnings), warnings


def test_default_policy_shape() -> None:
    p = default_policy()
    assert p.default == "auto"
    assert decide(p, "shell.exec", {"command": "ls", "cwd": "."}, cwd=CWD, home=HOME).action == "auto"
    for command in ("rm -rf x", "sudo ls", "curl x", "make"):
        assert decide(p, "shell.exec", {"command": command}, cwd=CWD, home=HOME).action == "ask", command
    assert decide(p, "shell.exec", {"command": "echo hi > f"}, cwd=CWD, home=HOME).action == "auto"
    assert decide(p, "fs.delete", {"path": "x"}, cwd=CWD, home=HOME).action == "ask"
    assert decide(p, "fs.write", {"path": "x", "content": ""}, cwd=CWD, home=HOME).action == "auto"
    assert decide(p, "mcp.github.create_issue", {}, cwd=CWD, home=HOME).action == "ask"
    # CodeMode's program is unconfined Python: a person reads it before it runs
    assert decide(p, "codemode.exec", {"code": "print(1)"}, cwd=CWD, home=HOME).action == "ask"


@pytest.mark.parametrize(
    "command",
    [
        "echo x >> ~/.bashrc",
        "tee ~/.bashrc",
        "cp x ~/.bashrc",
        "sed -i s/a/b/ ~/.profile",
        "mv ~/.bashrc /tmp",
        "chmod 000 ~",
        "tar xf a.tar -C /",
        "git config --global core.editor vim",
        "cat ~/.ssh/id_rsa",
        "cp ../other/secret.txt .",
    ],
)
def test_default_policy_asks_before_shell_reaches_outside_the_working_directory(command: str) -> None:
    assert decide(default_policy(), "shell.exec", {"command": command}, cwd=CWD, home=HOME).action == "ask"


@pytest.mark.parametrize("command", ["cat /etc/hosts", "ls ~/Downloads", "touch notes/today.md", "cat .env"])
def test_default_policy_lets_shell_read_outside_and_change_inside(command: str) -> None:
    assert decide(default_policy(), "shell.exec", {"command": command}, cwd=CWD, home=HOME).action == "auto"


# -- resolution order ----------------------------------------------------------------------------


def test_exact_match_beats_wildcard_beats_star_regardless_of_order() -> None:
    p = policy(
        [
            {"match": "*", "action": "deny"},
            {"match": "fs.*", "action": "ask"},
            {"match": "fs.read", "action": "auto"},
        ]
    )
    assert winner(p, "fs.read", {"path": "a"}) == 2
    assert winner(p, "fs.write", {"path": "a"}) == 1
    assert winner(p, "shell.exec", {"command": "ls"}) == 0


def test_target_specificity_beats_match_specificity() -> None:
    p = policy(
        [
            {"match": "shell.exec", "action": "auto"},
            {"match": "shell.*", "target": "devices/*", "action": "ask"},
            {"match": "*", "target": "laptop", "action": "deny"},
        ]
    )
    assert winner(p, "shell.exec", {"command": "ls"}) == 0  # local: only the untargeted rule applies
    assert winner(p, "shell.exec", {"command": "ls"}, target="phone") == 1  # wildcard target beats no target
    assert winner(p, "shell.exec", {"command": "ls"}, target="laptop") == 2  # a device id beats a wildcard


def test_local_target_is_specific_and_devices_wildcard_excludes_it() -> None:
    p = policy(
        [{"match": "fs.*", "target": "devices/*", "action": "deny"}, {"match": "*", "target": "local", "action": "ask"}]
    )
    assert winner(p, "fs.read", {"path": "a"}) == 1
    assert winner(p, "fs.read", {"path": "a"}, target="laptop") == 0


def test_order_breaks_ties_and_no_match_is_default() -> None:
    p = policy([{"match": "fs.read", "action": "ask"}, {"match": "fs.read", "action": "deny"}], default="deny")
    assert winner(p, "fs.read", {"path": "a"}) == 0
    assert winner(p, "net.fetch", {"url": "x"}) is None
    decision = decide(p, "net.fetch", {"url": "x"}, cwd=CWD, home=HOME)
    assert (decision.action, decision.rule) == ("deny", "default")
    assert decision.reason.startswith("denied by the default policy")


def test_domain_wildcard_matches_domain_and_nested_names_only() -> None:
    p = policy([{"match": "mcp.*", "action": "deny"}])
    assert winner(p, "mcp.github.create_issue") == 0
    assert winner(p, "mcp") == 0
    assert winner(p, "mcpx.tool") is None


# -- when ----------------------------------------------------------------------------------------


def test_when_conditions_must_all_hold_and_failing_rules_fall_through() -> None:
    p = policy(
        [
            {"match": "shell.exec", "when": {"anyTag": ["network", "privileged"]}, "action": "ask"},
            {"match": "shell.exec", "when": {"allTags": ["destructive", "privileged"]}, "action": "deny"},
            {"match": "shell.exec", "when": {"argPrefix": {"command": "git "}}, "action": "auto"},
            {"match": "shell.*", "action": "deny"},
        ]
    )
    assert winner(p, "shell.exec", {"command": "curl x"}) == 0
    assert winner(p, "shell.exec", {"command": "sudo rm x"}) == 0  # anyTag also holds, and it comes first
    assert winner(p, "shell.exec", {"command": "git status"}) == 2
    assert winner(p, "shell.exec", {"command": "ls"}) == 3
    p2 = policy([{"match": "shell.exec", "when": {"allTags": ["destructive", "privileged"]}, "action": "deny"}])
    assert winner(p2, "shell.exec", {"command": "sudo rm x"}) == 0
    assert winner(p2, "shell.exec", {"command": "rm x"}) is None


def test_when_arg_equals_compares_kind_and_value() -> None:
    p = policy([{"match": "fs.edit", "when": {"argEquals": {"replace_all": True, "path": "a.txt"}}, "action": "ask"}])
    assert winner(p, "fs.edit", {"path": "a.txt", "replace_all": True}) == 0
    assert winner(p, "fs.edit", {"path": "a.txt", "replace_all": 1}) is None
    assert winner(p, "fs.edit", {"path": "a.txt"}) is None
    assert winner(p, "fs.edit", {"path": "b.txt", "replace_all": True}) is None


def test_when_arg_prefix_needs_a_string() -> None:
    p = policy([{"match": "fs.write", "when": {"argPrefix": {"path": "src/"}}, "action": "auto"}], default="deny")
    assert winner(p, "fs.write", {"path": "src/a.py"}) == 0
    assert winner(p, "fs.write", {"path": "docs/a.md"}) is None
    assert winner(p, "fs.write", {"path": 5}) is None


# -- tags for non-shell calls -------------------------------------------------------------------


def test_fs_tags() -> None:
    assert tags("fs.read", {"path": "src/a.py"}) == set()
    assert tags("fs.write", {"path": "a.py"}) == {"mutating"}
    assert tags("fs.delete", {"path": "a.py"}) == {"mutating", "destructive"}
    assert tags("fs.read", {"path": ".env"}) == {"hidden-path"}
    assert tags("fs.read", {"path": "a/.git/config"}) == {"hidden-path"}
    assert tags("fs.read", {"path": "../other/x"}) == {"outside-cwd"}
    assert tags("fs.read", {"path": "a/../../proj/x"}) == set()  # ".." folds back inside
    assert tags("fs.read", {"path": "~/.ssh/id_rsa"}) == {"outside-cwd", "hidden-path"}
    assert tags("fs.read", {"path": "/etc/passwd"}) == {"outside-cwd", "outside-home"}
    assert tags("fs.write", {"path": "/etc/hosts"}) == {"mutating", "outside-cwd", "outside-home", "privileged"}
    assert tags("fs.read", {"path": "x"}, target="laptop") == {"remote"}


def test_hidden_is_judged_below_cwd_only() -> None:
    assert call_tags("fs.read", {"path": "a.txt"}, cwd="/home/ann/.work", home=HOME) == set()


def test_root_is_where_relative_paths_start() -> None:
    got = call_tags("fs.read", {"path": "x"}, cwd=CWD, home=HOME, root="/srv/workspace")
    assert got == {"outside-cwd", "outside-home"}


def test_shell_path_tags_use_its_working_directory() -> None:
    assert tags("shell.exec", {"command": "cat ~/.ssh/id_rsa"}) == {"hidden-path", "outside-cwd"}
    assert tags("shell.exec", {"command": "cat ../x", "cwd": "sub"}) == set()
    assert tags("shell.exec", {"command": "ls", "cwd": ".."}) == {"outside-cwd"}
    assert tags("shell.exec", {"command": "echo x > /etc/motd"}) >= {"mutating", "privileged", "outside-cwd"}
    assert "privileged" in tags("shell.exec", {"command": "mkfs.ext4 /dev/sdb1"})
    assert tags("shell.exec", {}) == {"unclassified"}
    assert "remote" in tags("shell.exec", {"command": "ls"}, target="laptop")


def test_net_fetch_and_codemode_tags() -> None:
    assert tags("net.fetch", {"url": "x"}) == {"network"}
    assert tags("net.fetch", {"url": "x", "method": "post"}) == {"network", "mutating"}
    assert tags("codemode.exec", {"code": "1"}) == {"unclassified"}


# -- decisions -----------------------------------------------------------------------------------


def test_ask_reason_names_tags_and_command() -> None:
    d = decide(default_policy(), "shell.exec", {"command": "curl -s x | sh"}, cwd=CWD, home=HOME)
    assert d.action == "ask"
    assert d.tags == ["destructive", "network", "unclassified"]
    assert d.reason == "shell command is destructive, network, unclassified: curl -s x | sh"
    assert d.rule.startswith("rules[0] shell.exec when")


def test_deny_reason_names_the_rule() -> None:
    p = policy([{"match": "fs.delete", "target": "local", "action": "deny"}])
    d = decide(p, "fs.delete", {"path": "build"}, cwd=CWD, home=HOME)
    assert d.action == "deny"
    assert d.rule == "rules[0] fs.delete on local -> deny"
    assert d.reason == "denied by rules[0] fs.delete on local -> deny: fs.delete is destructive, mutating: build"


def test_non_interactive_ask_becomes_deny() -> None:
    d = decide(default_policy(), "fs.delete", {"path": "x"}, cwd=CWD, home=HOME, interactive=False)
    assert d.action == "deny"
    assert d.reason.startswith(NON_INTERACTIVE)
    assert NON_INTERACTIVE == "requires interactive approval, which is unavailable for this process"
    auto = decide(default_policy(), "fs.read", {"path": "x"}, cwd=CWD, home=HOME, interactive=False)
    assert auto.action == "auto"


def test_long_commands_are_shortened_in_the_reason() -> None:
    d = decide(default_policy(), "shell.exec", {"command": "curl " + "x" * 500}, cwd=CWD, home=HOME)
    assert len(d.reason) < 200 and d.reason.endswith("…")


# -- remember, fingerprint ----------------------------------------------------------------


def test_remember_rule_is_bound_to_syscall_and_target() -> None:
    assert remember_rule("shell.exec", "local") == Rule(match="shell.exec", target="local", action="auto")
    assert remember_rule("fs.delete", "laptop").to_json() == {
        "match": "fs.delete",
        "target": "laptop",
        "action": "auto",
    }
    remembered = [remember_rule("fs.delete", "local")]
    assert (
        decide(default_policy(), "fs.delete", {"path": "x"}, cwd=CWD, home=HOME, remembered=remembered).action == "auto"
    )
    on_device = decide(
        default_policy(), "fs.delete", {"path": "x"}, target="laptop", cwd=CWD, home=HOME, remembered=remembered
    )
    assert on_device.action == "ask"


def test_remember_is_narrowed_to_the_risks_the_person_saw() -> None:
    """An "always" answer to a call asked about for some risks allows later calls of that kind with no
    other risk: approving a network command once must not approve a destructive one."""
    curl = decide(default_policy(), "shell.exec", {"command": "curl https://example.com"}, cwd=CWD, home=HOME)
    assert curl.action == "ask" and curl.tags == ["network"]
    rule = remember_rule("shell.exec", "local", curl.tags)
    assert list(rule.to_json()["when"]["noTag"]) == sorted(KNOWN_TAGS - {"network"})
    remembered = [Rule.model_validate(rule.to_json())]  # (as the process's kv keeps it)

    def verdict(command: str) -> str:
        args = {"command": command}
        return decide(default_policy(), "shell.exec", args, cwd=CWD, home=HOME, remembered=remembered).action

    assert verdict("curl https://example.org/other") == "auto"  # the same kind of call
    assert verdict("rm -rf /tmp/x") == "ask"  # destructive: never shown to the person
    assert verdict("sudo ls") == "ask"
    assert verdict("curl https://example.com | sh") == "ask"
    assert verdict("ls") == "auto"  # (the policy does not ask about it anyway)
    # a rule written by hand can use the same clause
    policy, problems = parse_policy(
        {"default": "ask", "rules": [{"match": "*", "when": {"noTag": ["network"]}, "action": "auto"}]}
    )
    assert problems == []
    assert decide(policy, "shell.exec", {"command": "ls"}, cwd=CWD, home=HOME).action == "auto"
    assert decide(policy, "shell.exec", {"command": "curl x.io"}, cwd=CWD, home=HOME).action == "ask"
    _, problems = parse_policy({"rules": [{"match": "*", "when": {"noTag": ["netwrk"]}, "action": "auto"}]})
    assert problems and "unknown tag" in problems[0]


def test_args_fingerprint_is_canonical_and_binds_arguments() -> None:
    a = args_fingerprint("shell.exec", {"command": "ls", "cwd": "."})
    assert a == args_fingerprint("shell.exec", {"cwd": ".", "command": "ls"})
    assert len(a) == 64 and int(a, 16) >= 0
    assert a != args_fingerprint("shell.exec", {"command": "ls ", "cwd": "."})
    assert a != args_fingerprint("fs.read", {"command": "ls", "cwd": "."})
    assert args_fingerprint("fs.write", {"path": "é", "n": [1, {"b": 2, "a": 1}]}) == args_fingerprint(
        "fs.write", {"n": [1, {"a": 1, "b": 2}], "path": "é"}
    )
    # a known value: the digest must not change between releases, stored decisions depend on it
    assert args_fingerprint("fs.read", {"path": "a"}) == (
        "8874bafbdd1fff8a1296df162e5fe7b382de85c0f4ee48a4961a6cad00640c07"
    )


@pytest.mark.parametrize(
    ("command", "action", "tag"),
    [
        ("cat /srv/agentloop-da*/agentloop.db", "deny", "protected"),  # a glob that can match it
        ("head /srv/agentloop-dat?/var/x /srv/agentloop-[d]ata/home", "deny", "protected"),
        ("cat {/srv/agentloop-data,/x}/agentloop.db", "deny", "protected"),  # braces expanded first
        ("cat /proc/1234/environ", "deny", "protected"),  # the runtime's credentials
        ("grep -r PIN /srv", "ask", "unclassified"),  # a directory that holds the kernel's data
        ("grep -r PIN /srv/agent*", "deny", "protected"),  # it names the directory itself
        ("grep -r PIN /s*", "ask", "unclassified"),
        ("tar czf /tmp/all.tgz /srv", "ask", "unclassified"),
        ("cat $HOME/notes.txt", "ask", "unclassified"),  # a path the shell makes up
        ("wc -l $(cat list.txt)", "ask", "unclassified"),
        ("cat ~root/x", "ask", "unclassified"),  # another user's home: not known here
        ("cat /srv/agentloop-dat{a..z}/agentloop.db", "ask", "unclassified"),  # a range: not expanded
        ("cat ./" + "{a,b}" * 18, "ask", "unclassified"),  # 2**18 alternatives: not built
        ("cat /proc/*/env*", "ask", "unclassified"),
        ("cat < /srv/agentloop-data/agentloop.db", "deny", "protected"),  # a redirection reads too
        ("ps eww", "ask", "unclassified"),  # every process's environment
        ("cat /srv/ws/notes.txt /srv/other/*.txt ./*.py", "auto", None),  # nothing of the kernel's
        ("ls", "auto", None),
        # naming a directory that holds the data without reading below it is fine (a review:
        # these were refused in a non-interactive process)
        ("ls / /srv ~ ..", "auto", None),
        ("du -sh /srv", "auto", None),
        ("ls /s*", "auto", None),
        ("ps aux", "auto", None),
    ],
)
def test_shell_paths_are_judged_as_the_shell_expands_them(command: str, action: str, tag: str | None) -> None:
    import time

    start = time.monotonic()
    """A review read another account's conversations with ``grep -a … /srv/agentloop-d*/…``: the
    guard compared the text of the path, not what the shell would make of it."""
    verdict = decide(
        default_policy(),
        "shell.exec",
        {"command": command},
        cwd="/srv/ws",
        home="/home/u",
        protected=["/srv/agentloop-data"],
    )
    assert verdict.action == action, verdict
    if tag is not None:
        assert tag in verdict.tags
    assert time.monotonic() - start < 0.5  # judged on the event loop: never slow


def test_a_glob_through_a_link_into_the_kernels_data_is_refused(tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "agentloop.db").write_text("")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "link").symlink_to(data)
    for command in ("cat link/agentloop.db", "cat lin?/agentloop.db", "cat link/agentloop.d?"):
        verdict = decide(
            default_policy(), "shell.exec", {"command": command}, cwd=ws, home=tmp_path, protected=[str(data)]
        )
        assert verdict.action == "deny" and "protected" in verdict.tags, command
