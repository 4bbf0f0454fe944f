"""Chat traces (`run_chat(trace=...)`, `tiered-kv chat --trace`) and their plots (`tiered-kv plot`).

One real chat with a tiny random model, a byte tokenizer and a hot tier far smaller than the
conversation, so blocks move hot -> warm -> cold. Its trace is checked against facts gathered
independently of the recorder: a forward hook on the model counts the forward passes and
snapshots the store's pools and byte counters after each one; run_chat's own records give
the turns' TTFT and token counts; store.stats() gives the totals at the end.
"""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from helpers import tiny_model
from tiered_kv import TierStore, load_config
from tiered_kv.chat import run_chat
from tiered_kv.cli import main
from tiered_kv.errors import TraceError
from tiered_kv.scheduler import TIER_NAMES
from tiered_kv.store.reporting import Reporting
from tiered_kv.trace import TraceRecorder, read_trace
from tiered_kv.trace.plot import PNG_NAMES

NUM_TURNS = 4
NEW_TOKENS = 8
MESSAGES = ["Tell me about caches.", "And about paging?", "Why does it help?", "Summarize all that."]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ByteTokenizer:
    """Token ids are UTF-8 bytes (the tiny models' vocabulary has 256 ids); a ChatML template."""

    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def _config(cold_dir) -> dict:
    # hot holds 6 blocks of 4 tokens; one turn's prompt alone is ~18 blocks: everything moves
    return {"block_size": 4, "hot": {"device": "cpu", "capacity_blocks": 6}, "warm": {"capacity_blocks": 10},
            "cold": {"capacity_blocks": 256, "path": str(cold_dir)},
            "scheduler": {"background": False},  # no mover: every move happens inside a step or attach()
            "attention": {"sample_steps": 0.5}}  # every other decode step measures its attention mass


def _counters_now(store) -> tuple[dict, dict]:
    return ({name: store.pools[t].num_used for t, name in enumerate(TIER_NAMES)}, dict(store.reporting.bytes_moved))


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """Run the chat once for the whole module; return what the tests compare the trace with."""
    root = tmp_path_factory.mktemp("trace")
    model = tiny_model("llama")
    store = TierStore(load_config(_config(root / "cold")))
    after_forward = []  # the store's pools and bytes after each forward pass, seen by the model's hook
    handle = model.register_forward_hook(lambda *_: after_forward.append(_counters_now(store)))
    num_stats_calls = {"n": 0}
    real_stats = Reporting.stats

    def counting_stats(self):
        num_stats_calls["n"] += 1
        return real_stats(self)

    path = root / "new-dir" / "out.jsonl"  # the folder does not exist yet
    recorder = TraceRecorder(path)
    Reporting.stats = counting_stats
    try:
        records = run_chat(model, ByteTokenizer(), store.config, MESSAGES, NEW_TOKENS, out=None, store=store,
                           trace=recorder)
    finally:
        Reporting.stats = real_stats
        handle.remove()
    lines_before_close = path.read_text().splitlines()  # the caller's recorder: flushed per turn, not closed
    recorder.close()
    final_stats = store.stats()
    store.close()
    return {"path": path, "root": root, "records": records, "after_forward": after_forward,
            "stats": final_stats, "capacities": final_stats["tiers"], "lines_before_close": lines_before_close,
            "num_stats_calls": num_stats_calls["n"]}


def test_one_step_line_per_forward_pass(chat):
    trace = read_trace(chat["path"])
    assert len(chat["after_forward"]) == NUM_TURNS * NEW_TOKENS  # prefill + (new tokens - 1) decodes per turn
    assert len(trace.steps) == len(chat["after_forward"])
    for turn, record in enumerate(chat["records"], start=1):
        steps = [s for s in trace.steps if s["turn"] == turn]
        assert [s["step"] for s in steps] == list(range(NEW_TOKENS))
        assert [s["kind"] for s in steps] == ["prefill"] + ["decode"] * (NEW_TOKENS - 1)
        assert steps[0]["new_tokens"] == record["computed_tokens"]
        assert [s["new_tokens"] for s in steps[1:]] == [1] * (NEW_TOKENS - 1)
        assert steps[0]["seq_tokens"] == record["prompt_tokens"]
        assert steps[-1]["seq_tokens"] == record["seq_tokens"] - 1  # the last new token is never fed back
    times = [s["t_s"] for s in trace.steps]
    assert times == sorted(times) and all(s["step_s"] > 0 for s in trace.steps)
    assert trace.end["num_steps"] == len(trace.steps) and trace.end["num_turns"] == NUM_TURNS


def test_step_lines_match_the_store_after_each_forward(chat):
    trace = read_trace(chat["path"])
    for i, (step, (used, moved)) in enumerate(zip(trace.steps, chat["after_forward"])):
        assert step["used_blocks"] == used, f"step line {i}"
        assert step["bytes_moved"] == moved, f"step line {i}"
        assert step["capacity_blocks"] == {n: chat["capacities"][n]["capacity_blocks"] for n in TIER_NAMES}
    previous = {d: 0 for d in trace.steps[0]["bytes_moved"]}
    for step in trace.steps:  # deltas add up to the cumulative figures
        assert step["bytes_moved_delta"] == {d: step["bytes_moved"][d] - previous[d] for d in previous}
        previous = step["bytes_moved"]
    # the chat really moved blocks down through every tier
    last = trace.steps[-1]
    assert last["bytes_moved"] == chat["stats"]["bytes_moved"]
    assert last["moves"] == chat["stats"]["moves"]
    assert last["bytes_moved"]["hot->warm"] > 0 and last["bytes_moved"]["warm->cold"] > 0
    assert max(s["used_blocks"]["cold"] for s in trace.steps) > 0


def test_turn_lines_match_run_chat_records(chat):
    trace = read_trace(chat["path"])
    assert [t["turn"] for t in trace.turns] == list(range(1, NUM_TURNS + 1))
    for line, record in zip(trace.turns, chat["records"]):
        for key in ("ttft_s", "prompt_tokens", "reused_tokens", "computed_tokens", "new_tokens", "seq_tokens",
                    "decode_tokens_per_s"):
            assert line[key] == record[key], (line["turn"], key)
        assert line["num_steps"] == NEW_TOKENS
    assert trace.turns[0]["turn_blocks"] == 0 and trace.turns[0]["hit_rate"] == dict.fromkeys(TIER_NAMES)
    assert all(t["reused_tokens"] > 0 and t["turn_blocks"] > 0 for t in trace.turns[1:])
    stats = chat["stats"]
    assert sum(t["turn_blocks"] for t in trace.turns) == stats["turn_blocks"]
    for name in TIER_NAMES:  # per-turn hit rates weighted by blocks give the store's hit counts
        hits = sum(t["hit_rate"][name] * t["turn_blocks"] for t in trace.turns[1:])
        assert hits == pytest.approx(stats["hit_rate"][name] * stats["turn_blocks"])
        assert sum(t["bytes_moved"][d] for t in trace.turns for d in [f"{name}->{o}" for o in TIER_NAMES
                                                                    if o != name]) == \
            sum(stats["bytes_moved"][f"{name}->{o}"] for o in TIER_NAMES if o != name)
    assert trace.turns[-1]["hit_rate"]["cold"] > 0  # later turns found history in cold


def test_turn_lines_say_where_the_sampled_attention_mass_lay(chat):
    """Each turn line: the decode steps sampled in that turn, the bank's mass share per tier after it."""
    turns = [json.loads(line) for line in chat["path"].read_text().splitlines() if json.loads(line)["type"] == "turn"]
    assert len(turns) == NUM_TURNS
    sampled = [turn["attention"]["sampled_steps"] for turn in turns]
    # decode steps only (the first token of a turn comes from its prefill), every other one sampled
    assert sum(sampled) == chat["records"][-1]["stats"]["attention"]["sampled_steps"] > 0
    assert all(n == (NEW_TOKENS - 1) // 2 or n == NEW_TOKENS // 2 for n in sampled), sampled
    for turn, record in zip(turns, chat["records"]):
        shares = turn["attention"]["mass_share_by_tier"]
        assert shares == record["stats"]["attention"]["mass_share_by_tier"]
        assert set(shares) == set(TIER_NAMES) and abs(sum(shares.values()) - 1) < 1e-6
        assert turn["attention"]["sparse_read_share_below_hot"] is None  # sparse reads are off
    assert turns[-1]["attention"]["mass_share_by_tier"]["cold"] > 0  # history spilled to cold draws attention too
    assert read_trace(chat["path"]).turns[0]["attention"] == turns[0]["attention"]


def test_header_file_mode_and_flush_per_turn(chat):
    trace = read_trace(chat["path"])
    start = trace.start
    assert start["version"] == 1 and start["block_size"] == 4 and start["hooks_mode"] == "exact"
    for name in TIER_NAMES:
        capacity = chat["capacities"][name]
        assert start["tiers"][name] == {"capacity_blocks": capacity["capacity_blocks"],
                                        "capacity_bytes": capacity["capacity_bytes"]}
    assert stat.S_IMODE(os.stat(chat["path"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(chat["path"].parent).st_mode) == 0o700
    # before close: every turn's lines were on disk, the end line not yet
    kinds = [json.loads(line)["type"] for line in chat["lines_before_close"]]
    assert kinds == ["start"] + (["step"] * NEW_TOKENS + ["turn"]) * NUM_TURNS
    assert trace.is_complete


def test_tracing_calls_no_stats_per_step(chat):
    assert chat["num_stats_calls"] == NUM_TURNS  # run_chat's own bank.stats() per turn, nothing more


def test_a_second_recorder_writing_over_an_existing_file_makes_it_0600(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("old")
    os.chmod(path, 0o644)
    TraceRecorder(path).close()  # never started: nothing to keep
    assert not path.exists()
    recorder = TraceRecorder(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.read_text() == ""
    recorder._file.close()


def test_unwritable_trace_path_names_it(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "out.jsonl"  # a file where a folder should be (holds for root too)
    with pytest.raises(TraceError, match="a-file/out.jsonl"):
        TraceRecorder(bad)
    status = main(["chat", "--trace", str(bad), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and "a-file/out.jsonl" in err and "cannot write" in err


# ---- tiered-kv plot ------------------------------------------------------------------------------
def test_plot_writes_four_pngs(chat, tmp_path, capsys):
    out_dir = tmp_path / "png"
    assert main(["plot", str(chat["path"]), "-o", str(out_dir)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out_dir / name) for name in PNG_NAMES]
    for name in PNG_NAMES:
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def _lines(chat) -> list[str]:
    return chat["path"].read_text().splitlines(keepends=True)


def _bad(tmp_path, text: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize("damage, line, words", [
    ("truncated", "last", "truncated"),
    ("garbage", 3, "not JSON"),
    ("array", 2, "an array, not a JSON object"),
    ("no_used_blocks", 5, "without the 'used_blocks' field"),
    ("bad_kind", 4, "'kind'"),
    ("step_first", 1, "begins with its 'start' record"),
    ("blank", 6, "empty line"),
])
def test_plot_names_the_bad_line_and_exits_2(chat, tmp_path, capsys, damage, line, words):
    lines = _lines(chat)
    if damage == "truncated":
        lines[-1] = lines[-1][: len(lines[-1]) // 2]  # the file ends mid-record
        line = len(lines)
    elif damage == "garbage":
        lines[2] = "this is not json\n"
    elif damage == "array":
        lines[1] = "[1, 2, 3]\n"
    elif damage == "no_used_blocks":
        record = json.loads(lines[4])
        del record["used_blocks"]
        lines[4] = json.dumps(record) + "\n"
    elif damage == "bad_kind":
        record = json.loads(lines[3])
        record["kind"] = "sideways"
        lines[3] = json.dumps(record) + "\n"
    elif damage == "step_first":
        lines = lines[1:]
    elif damage == "blank":
        lines[5] = "\n"
    path = _bad(tmp_path, "".join(lines))
    with pytest.raises(TraceError, match=f"line {line}: .*{words}"):
        read_trace(path)
    status = main(["plot", str(path), "-o", str(tmp_path / "png")])
    err = capsys.readouterr().err
    assert status == 2 and str(path) in err and f"line {line}:" in err and words in err, err
    assert not (tmp_path / "png").exists()


def test_plot_empty_or_missing_file_exits_2(tmp_path, capsys):
    empty = _bad(tmp_path, "")
    assert main(["plot", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_plot_of_a_trace_cut_at_a_line_end_draws_what_it_holds(chat, tmp_path, capsys):
    lines = _lines(chat)
    path = _bad(tmp_path, "".join(lines[:NEW_TOKENS + 5]))  # turn 1 whole, 3 steps of turn 2, no end line
    trace = read_trace(path)
    assert not trace.is_complete and len(trace.turns) == 1
    assert main(["plot", str(path), "-o", str(tmp_path / "png")]) == 0
    assert "no end line" in capsys.readouterr().err
    assert all((tmp_path / "png" / name).read_bytes().startswith(PNG_MAGIC) for name in PNG_NAMES)


def test_plot_without_matplotlib_says_how_to_install(chat, tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["plot", str(chat["path"]), "-o", str(tmp_path / "png")]) == 2
    assert "pip install 'tiered_kv[plot]'" in capsys.readouterr().err


def test_the_chat_cli_default_hooks_mode_is_merge_on_a_cpu_store_and_its_tokens_equal_exact(tmp_path):
    """`tiered-kv chat` defaults to --hooks-mode auto: merge when hot is on the CPU (warm runs read
    in place), exact on a GPU. The same chat, spilled through warm and cold, gives the same replies
    in both modes."""
    from tiered_kv.chat import auto_hooks_mode
    assert auto_hooks_mode("cpu") == "merge" and auto_hooks_mode("cuda:0") == "exact"
    replies = {}
    for mode in ("auto", "exact"):
        cfg = {"block_size": 4, "hot": {"device": "cpu", "capacity_blocks": 6}, "warm": {"capacity_blocks": 10},
               "cold": {"capacity_blocks": 256, "path": str(tmp_path / mode)}}
        records = run_chat(tiny_model("llama"), ByteTokenizer(), cfg, MESSAGES, NEW_TOKENS, out=None,
                           hooks_mode=mode)
        assert records[-1]["stats"]["hooks"]["mode"] == ("merge" if mode == "auto" else "exact")
        replies[mode] = [r["reply"] for r in records]
    assert records[-1]["stats"]["tiers"]["warm"]["used_blocks"] + records[-1]["stats"]["tiers"]["cold"][
        "used_blocks"] > 0
    assert replies["auto"] == replies["exact"]
