"""Attention-aware tiers (issue 37): attention mass per block sampled on decode steps, placement by
it (`scheduler.attention_weight`), and sparse reads of spilled history (`attention.sparse`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import greedy, rand_ids, reference, tier_config, tiny_model

import tiered_kv
from tiered_kv.bank.attention_stats import sampled_layers
from tiered_kv.bank.sparse import KeySummaries
from tiered_kv.errors import ConfigError
from tiered_kv.scheduler.access_log import AccessLog
from tiered_kv.scheduler.policies import policy_for


def spilled_config(tmp_path, hot_blocks: int = 4, **attention) -> dict:
    config = tier_config("forces_warm", tmp_path / "cold")
    config["hot"]["capacity_blocks"] = hot_blocks
    config["attention"] = attention
    return config


def run(model, config, ids, new_tokens: int, mode: str | None = "merge", inspect=None):
    """greedy() through a bank with the hooks in `mode` (None: none): the tokens, its stats, and
    what `inspect(bank)` returns before the bank closes."""
    bank = tiered_kv.CacheBank(model, config)
    if mode is not None:
        tiered_kv.hooks.install(model, bank, mode=mode)
    try:
        with torch.no_grad():
            out = greedy(model, ids, bank, new_tokens)
        return out, bank.stats(), inspect(bank) if inspect is not None else None
    finally:
        if mode is not None:
            tiered_kv.hooks.uninstall(model)
        bank.close()


# ---- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, key", [
    ({"sparse": {"budget": 0}}, "attention.sparse.budget"),
    ({"sparse": {"budget": 1.5}}, "attention.sparse.budget"),
    ({"sparse": {"budget": True}}, "attention.sparse.budget"),
    ({"sparse": {"budget": "all"}}, "attention.sparse.budget"),
    ({"sparse": {"budget": -3}}, "attention.sparse.budget"),
    ({"sparse": {"recent": 2}}, "attention.sparse.recent"),
    ({"sparse": {"first_blocks": -1}}, "attention.sparse.first_blocks"),
    ({"sample_steps": 1.5}, "attention.sample_steps"),
    ({"sample_layers": -0.1}, "attention.sample_layers"),
    ({"decay": 1.0}, "attention.decay"),
    ({"sparse": [0.25]}, "attention.sparse"),
])
def test_bad_attention_settings_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiered_kv.load_config({"attention": bad})


def test_attention_weight_is_a_share_and_the_section_round_trips():
    with pytest.raises(ConfigError, match=r"scheduler\.attention_weight"):
        tiered_kv.load_config({"scheduler": {"attention_weight": 2}})
    config = tiered_kv.load_config({"attention": {"sparse": {"budget": 16}}, "scheduler": {"attention_weight": 0.5}})
    again = tiered_kv.load_config(config.to_dict())
    assert again.attention == config.attention and again.attention.sparse.budget == 16
    assert config.attention.sparse.blocks(100) == 16
    assert tiered_kv.load_config({"attention": {"sparse": {"budget": 0.25}}}).attention.sparse.blocks(100) == 25
    assert not tiered_kv.load_config({}).attention.sparse.enabled


def test_sampled_layers_are_spread():
    assert sampled_layers(30, 0.25) == frozenset({0, 3, 7, 11, 15, 18, 22, 26})
    assert sampled_layers(2, 1.0) == frozenset({0, 1}) and sampled_layers(4, 0.0) == frozenset()


# ---- attention mass --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ("exact", "merge"))
def test_sampled_steps_measure_each_blocks_share_and_change_no_token(mode, tmp_path):
    model = tiny_model("llama")
    ids = rand_ids(3, 45)
    config = spilled_config(tmp_path, sample_steps=1.0, sample_layers=1.0)
    out, stats, masses = run(model, config, ids, 10, mode,
                             lambda bank: bank.store.access_log.attention_mass(np.asarray(bank.seq.rows[0].table)))
    assert torch.equal(out, reference(model, ids, 10))  # observing changes nothing
    attention = stats["attention"]
    assert attention["sampled_steps"] == attention["decode_steps"] == 9
    shares = attention["mass_share_by_tier"]
    assert abs(sum(shares.values()) - 1) < 1e-6 and shares["warm"] > 0 and shares["hot"] > 0
    assert np.all(masses >= 0) and np.all(masses <= 1) and masses.sum() > 0.5  # averaged shares of each step


def test_a_blocks_mass_is_its_share_of_the_steps_attention(tmp_path):
    """One sampled step at one layer: the recorded masses are softmax(q.K) summed per block."""
    model = tiny_model("llama")
    ids = rand_ids(4, 33)
    seen = {}
    from tiered_kv.bank import attention_stats

    real = attention_stats.StepProbe.observe

    def observe(self, layer, query, key, scale, block_positions=None):
        seen.update(query=query.clone(), key=key.clone(), scale=scale, table=list(self.table))
        return real(self, layer, query, key, scale, block_positions)

    attention_stats.StepProbe.observe = observe
    try:
        _, _, got = run(model, spilled_config(tmp_path, sample_steps=1.0, sample_layers=0.01), ids, 2, "exact",
                        lambda bank: (bank.store.access_log.attention_mass(np.asarray(seen["table"])),
                                      bank.config.block_size))
    finally:
        attention_stats.StepProbe.observe = real
    got, bs = got
    q, k = seen["query"][0, :, -1], seen["key"][0]
    heads = k.shape[0]
    probs = torch.softmax(q.view(heads, -1, q.shape[-1]) @ k.transpose(1, 2) * seen["scale"], -1).mean((0, 1))
    expected = [float(probs[i * bs:(i + 1) * bs].sum()) for i in range(len(seen["table"]))]
    assert np.allclose(got, expected, atol=1e-6)


def test_no_hooks_no_samples(tmp_path):
    model = tiny_model("llama")
    _, stats, _ = run(model, spilled_config(tmp_path, sample_steps=1.0), rand_ids(3, 40), 5, mode=None)
    assert stats["attention"]["sampled_steps"] == 0


def test_the_access_log_averages_samples_then_decays():
    log = AccessLog(window_steps=10)
    log.record_attention([1, 2], [0.6, 0.1], decay=0.8)
    assert np.allclose(log.attention_mass([1, 2, 3]), [0.6, 0.1, 0.0])  # a first sample is taken as it is
    log.record_attention([1, 2], [0.0, 0.3], decay=0.8)
    assert np.allclose(log.attention_mass([1, 2]), [0.3, 0.2])  # the mean while samples are few
    for _ in range(20):
        log.record_attention([1], [0.0], decay=0.8)
    assert log.attention_mass([1])[0] < 0.01


class _Index:
    def __init__(self, ids):
        self.ids = ids

    def arrival_steps(self, ids):
        return np.zeros(len(ids), dtype=np.int64)


@pytest.mark.parametrize("policy", ("lru", "lfu", "fifo", "turns"))
def test_attention_weight_orders_a_chats_blocks_by_mass(policy):
    log = AccessLog(window_steps=10)
    ids = np.arange(1, 6)
    log.record_step(7, ids, [list(ids)], 0.5)
    log.record_attention(ids, [0.5, 0.05, 0.3, 0.0, 0.15], decay=0.8)
    flat = policy_for(policy, _Index(ids), log, cs_weight=0.5).values(ids)
    weighted = policy_for(policy, _Index(ids), log, cs_weight=0.5, attention_weight=1.0).values(ids)
    assert len(set(flat.tolist())) == 1  # one chat, one step: no policy tells its blocks apart
    assert list(np.argsort(weighted, kind="stable")) == [3, 1, 4, 2, 0]  # low mass goes down first


# ---- sparse reads ------------------------------------------------------------------------------------

def test_key_summaries_bound_every_key_of_their_block():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 37, 8, generator=gen)
    summaries = KeySummaries(num_layers=1, block_size=4)
    summaries.write(0, 0, keys[:, :, :13])
    summaries.committed(0, 13, False)
    for t in range(13, 37):
        summaries.write(0, t, keys[:, :, t:t + 1])
        summaries.committed(t, t + 1, False)
    assert summaries.complete(10)
    blocks = keys[0].transpose(0, 1)  # [t, H, D]
    for b in range(10):
        part = blocks[b * 4:(b + 1) * 4]
        assert torch.equal(summaries.low[0, b], part.amin(0)) and torch.equal(summaries.high[0, b], part.amax(0))


def test_a_budget_of_every_block_is_exact_and_a_small_one_reads_less(tmp_path):
    model = tiny_model("llama")
    ids = rand_ids(5, 60)
    expected = reference(model, ids, 16)
    out, stats, _ = run(model, spilled_config(tmp_path / "a", sparse={"budget": 1.0}), ids, 16)
    assert torch.equal(out, expected)
    assert stats["hooks"]["steps_by_read"]["sparse"] == 15
    assert stats["attention"]["sparse"]["read_share_below_hot"] == 1.0
    out, stats, _ = run(model, spilled_config(tmp_path / "b", sparse={"budget": 2, "first_blocks": 1,
                                                                        "recent_blocks": 1}), ids, 16)
    sparse = stats["attention"]["sparse"]
    assert stats["hooks"]["steps_by_read"]["sparse"] == 15 and sparse["steps"] == 15
    assert sparse["read_share_below_hot"] < 0.35  # at most the 2 ranked + the first block of ~10 below hot
    assert out.shape == expected.shape


@pytest.mark.parametrize("mode", ("exact", None))
def test_exact_mode_and_no_hooks_read_everything(mode, tmp_path):
    model = tiny_model("llama")
    ids = rand_ids(5, 50)
    out, stats, _ = run(model, spilled_config(tmp_path, sparse={"budget": 1}), ids, 8, mode)
    assert torch.equal(out, reference(model, ids, 8))
    assert stats["hooks"]["steps_by_read"]["sparse"] == 0


def test_sliding_window_models_read_their_windows_whole(tmp_path):
    model = tiny_model("mistral_sw")
    ids = rand_ids(6, 50)
    out, stats, _ = run(model, spilled_config(tmp_path, sparse={"budget": 1}), ids, 8)
    assert stats["hooks"]["steps_by_read"]["sparse"] == 0
    assert torch.equal(out, reference(model, ids, 8))


def test_after_attach_the_first_step_reads_everything_then_sparse(tmp_path):
    """A restored chat's blocks have no key summaries: its prefill reads them all (and summarises
    them), the decode steps after it are sparse."""
    model = tiny_model("llama")
    config = spilled_config(tmp_path, sparse={"budget": 2})
    config["cold"]["capacity_blocks"] = 64
    ids = rand_ids(7, 50)
    store = tiered_kv.TierStore(config)
    first = tiered_kv.CacheBank(model, store=store)
    with torch.no_grad():
        out = greedy(model, ids, first, 4)
    first.close()
    second = tiered_kv.CacheBank(model, store=store)
    tiered_kv.hooks.install(model, second, mode="merge")
    try:
        turn = torch.cat([out, rand_ids(8, 5)], 1)
        assert second.attach(turn) > 0
        with torch.no_grad():
            greedy(model, turn, second, 6)
        counts = second.stats()["hooks"]["steps_by_read"]
        assert counts["sparse"] == 5 and sum(counts.values()) == 6  # the prefill read everything
    finally:
        tiered_kv.hooks.uninstall(model)
        second.close()
        store.close()


def test_metrics_and_diagnose_report_the_mass_each_tier_served(tmp_path):
    from tiered_kv.metrics.export import exposition
    from tiered_kv.tools.diagnose_report import attention_text

    model = tiny_model("llama")
    config = spilled_config(tmp_path, sample_steps=1.0, sparse={"budget": 2})
    _, stats, text = run(model, config, rand_ids(3, 45), 6, "merge", lambda bank: exposition([bank.store]))
    assert 'tiered_kv_attention_mass_share{tier="warm"}' in text and 'tier="hot"' in text
    line = attention_text(stats["attention"])
    assert line.startswith("attention: 5 of 5 decode steps sampled") and "warm" in line
    assert "sparse reads (budget 2): 5 steps read" in line


def test_a_reused_bank_never_ranks_by_another_chats_summaries(tmp_path):
    """reset() and a new chat in the same bank: its sparse steps pick exactly as a fresh bank's do."""
    model = tiny_model("llama")
    config = spilled_config(tmp_path, sparse={"budget": 2})
    first, second = rand_ids(11, 50), rand_ids(12, 50)

    def decode_logits(bank, ids, steps=6):
        out = []
        with torch.no_grad():
            logits = model(input_ids=ids, cache=bank, use_cache=True).logits[:, -1:]
            for _ in range(steps):
                logits = model(input_ids=logits.argmax(-1), cache=bank, use_cache=True).logits[:, -1:]
                out.append(logits)
        return torch.cat(out, 1)

    fresh = tiered_kv.CacheBank(model, config)
    reused = tiered_kv.CacheBank(model, store=fresh.store)
    tiered_kv.hooks.install(model, reused, mode="merge")
    try:
        decode_logits(reused, first)
        reused.reset()
        again = decode_logits(reused, second)
        assert reused.stats()["hooks"]["steps_by_read"]["sparse"] >= 6
        tiered_kv.hooks.install(model, fresh, mode="merge")
        assert torch.equal(again, decode_logits(fresh, second))
    finally:
        tiered_kv.hooks.uninstall(model)
        reused.close()
        fresh.close()


def test_a_ranked_layer_over_the_device_slab_reads_nothing_back_to_the_host(tmp_path, monkeypatch):
    """Invariant 9 on a sparse step: the blocks it reads are chosen on the device (top-k, indices,
    gather), with no .cpu() / .item() / .tolist() / .numpy() of a tensor; they are the blocks the
    host-side selection picks, and the tokens are those of a step that reads them the host's way."""
    from tiered_kv.bank.sparse import SparseStep

    model = tiny_model("llama")
    config = spilled_config(tmp_path / "a", sparse={"budget": 2, "first_blocks": 1, "recent_blocks": 1})
    ids = rand_ids(13, 60)
    host_reads, compared = [], []
    attend_on_slab = SparseStep._attend_on_slab

    def watched(self, module, query, layer, scale):
        compared.append(np.array_equal(self.device_blocks(layer, query).numpy(), self.selected(layer, query)))
        with pytest.MonkeyPatch.context() as tensor_patch:
            for name in ("cpu", "item", "tolist", "numpy"):
                real = getattr(torch.Tensor, name)
                tensor_patch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name, **k:
                                     host_reads.append(_name) or _real(t, *a, **k))
            return attend_on_slab(self, module, query, layer, scale)

    monkeypatch.setattr(SparseStep, "_attend_on_slab", watched)
    out, stats, _ = run(model, config, ids, 8)
    monkeypatch.undo()
    assert len(compared) == 7 * model.config.num_hidden_layers and all(compared) and host_reads == []
    assert stats["hooks"]["steps_by_read"]["sparse"] == 7
    monkeypatch.setattr(SparseStep, "_attend_on_slab", lambda *a: (_ for _ in ()).throw(AssertionError))
    monkeypatch.setattr(SparseStep, "attend", _host_path_attend(SparseStep.attend))
    host_out, _, _ = run(model, spilled_config(tmp_path / "b", sparse={"budget": 2, "first_blocks": 1,
                                                                         "recent_blocks": 1}), ids, 8)
    assert torch.equal(out, host_out)


def _host_path_attend(attend):
    """SparseStep.attend as it reads without the device slab (the lease's token runs)."""
    def host(self, plan, module, query, attention_mask, scale):
        self.device_slab = self.slab_block_positions = None
        return attend(self, plan, module, query, attention_mask, scale)
    return host


@pytest.mark.parametrize("below", ("cold", "warm-int8", "warm-records", "cold-thread"))
def test_sparse_steps_over_history_off_the_device_slab(below, tmp_path):
    """History below hot in cold, compressed or records-layout warm (not on the device slab): sparse
    steps read it through the lease; a budget of every block gives an exact step's tokens."""
    model = tiny_model("llama")
    ids = rand_ids(14, 60)
    engine = "thread" if below.endswith("thread") else "auto"

    def config(name, **sparse):
        c = tier_config("forces_cold" if below.startswith("cold") else "forces_warm", tmp_path / name / "cold",
                        engine=engine, delay_us=300, warm_layout="records" if below == "warm-records" else None)
        c["hot"]["capacity_blocks"] = 4
        if below == "warm-int8":
            c["warm"]["compression"] = "int8"
        c["attention"] = {"sparse": sparse} if sparse else {}
        return c

    exact, _, _ = run(model, config("exact"), ids, 10)
    every, stats, _ = run(model, config("every", budget=1.0), ids, 10)
    assert torch.equal(every, exact) and stats["hooks"]["steps_by_read"]["sparse"] == 9
    if below != "warm-int8":
        assert torch.equal(exact, reference(model, ids, 10))
    _, stats, _ = run(model, config("two", budget=2, first_blocks=1, recent_blocks=1), ids, 10)
    assert stats["hooks"]["steps_by_read"]["sparse"] == 9
    assert stats["attention"]["sparse"]["read_share_below_hot"] < 0.5
