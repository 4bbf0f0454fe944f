"""Crash recovery of the durable cold tier at the store level (issue 6, item 7): a writer process
SIGKILLed at random points, bit flips and truncation of the cold files between processes, and a
full disk. Afterwards `attach` reuses only intact, verified blocks and the continued chat is
token-identical to DynamicCache computing the whole conversation fresh.

The chats are deterministic (seeded prompt ids, greedy decoding, fixed weights), so the parent
knows every token a killed child generated: it computes the reference conversations once with
DynamicCache, before forking."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import time
import traceback

import pytest
import torch

import tiered_kv
from helpers import (BLOCK_SIZE, flip_cold_byte, greedy, mount_tmpfs, published_chain, rand_ids, reference,
                     tier_config, tiny_model, umount_tmpfs)
from tiered_kv import ConfigError
from tiered_kv.hw import block_io
from tiered_kv.scheduler import COLD

TURNS = [(12, 6), (4, 6), (4, 6)]  # (new user tokens, generated tokens) per turn
CONTINUE_TOKENS = 4
NUM_CONVERSATIONS = 3


def crash_config(cold_dir, cold_blocks: int = 20) -> dict:
    """Hot 2 and warm 3 blocks: every turn pushes blocks to cold; cold smaller than all the
    conversations together, so published blocks get evicted and their slots reused."""
    config = tier_config("forces_cold", cold_dir)
    config["cold"]["capacity_blocks"] = cold_blocks
    return config


class Conversation:
    """One deterministic chat: the inputs of each turn, what greedy decoding answers (computed by
    DynamicCache), and a follow-up `follow` whose continuation is the reference for a reattach."""

    def __init__(self, model, seed: int):
        self.turn_inputs, self.turn_outputs = [], []
        ids = None
        for turn, (num_user, num_new) in enumerate(TURNS):
            user = rand_ids(1000 * seed + turn, num_user)
            ids = user if ids is None else torch.cat([ids, user], 1)
            self.turn_inputs.append(ids)
            ids = reference(model, ids, num_new)
            self.turn_outputs.append(ids)
        self.history = ids.shape[1] - 1  # tokens whose KV a chat computed (not the last generated one)
        self.follow = torch.cat([ids, rand_ids(1000 * seed + 99, 3)], 1)
        self.follow_tokens = reference(model, self.follow, CONTINUE_TOKENS)
        with torch.no_grad():
            self.follow_logits = model(self.follow).logits


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # before any torch work: the forked children then run torch safely
    return tiny_model("llama")


@pytest.fixture(scope="module")
def conversations(model):
    return [Conversation(model, seed) for seed in range(1, NUM_CONVERSATIONS + 1)]


def check_reattach(model, store, conversation, history: int | None = None) -> tuple[int, list[int]]:
    """A new bank on `store` attaches `conversation.follow`: a whole number of blocks, no more than
    the verified history (`history` tokens, by default what the chat itself computed), every reused block intact; continuing it equals DynamicCache (tokens) and
    the reused KV gives the logits of a fresh forward. Returns (reused tokens, reused block ids)."""
    bank = tiered_kv.CacheBank(model, store=store)
    try:
        reused = bank.attach(conversation.follow)
        table = bank.block_table()
        history = conversation.history if history is None else history
        assert reused % BLOCK_SIZE == 0 and 0 <= reused <= history, (reused, history)
        assert len(table) == reused // BLOCK_SIZE
        assert store.verify(table) == []
        assert torch.equal(greedy(model, conversation.follow, bank, CONTINUE_TOKENS), conversation.follow_tokens)
    finally:
        bank.close()
    if reused:
        bank = tiered_kv.CacheBank(model, store=store)
        try:
            assert bank.attach(conversation.follow) >= reused
            start = bank.get_seq_length()
            with torch.no_grad():
                logits = model(conversation.follow[:, start:], past_key_values=bank, use_cache=True).logits
            torch.testing.assert_close(logits, conversation.follow_logits[:, start:], rtol=1e-4, atol=1e-5)
        finally:
            bank.close()
    return reused, table


def assert_within_capacity(store) -> None:
    for name, tier in store.stats()["tiers"].items():
        assert tier["used_blocks"] <= tier["capacity_blocks"], (name, tier)


# --- SIGKILL of a writer at random points ------------------------------------------------------

def _writer(model, conversations, cold_dir, trial: int, error_path: str) -> None:
    """The killed child: chat the conversations on one store, over and over, until killed. Banks
    start at a random turn (attach reuses what the store holds), sometimes offload to cold, are
    sometimes left open. Every answer is checked; a wrong one (or any error) is written to
    `error_path` and ends the child with status 1, which the parent reports."""
    rng = random.Random(trial)
    store = tiered_kv.TierStore(crash_config(cold_dir))
    banks = []
    for i in range(10**9):
        conversation = conversations[rng.randrange(len(conversations))]
        bank = tiered_kv.CacheBank(model, store=store)
        first_turn = rng.choice([0, 0, 1, 2])
        bank.attach(conversation.turn_inputs[first_turn])
        for turn in range(first_turn, len(TURNS)):
            out = greedy(model, conversation.turn_inputs[turn], bank, TURNS[turn][1])
            if not torch.equal(out, conversation.turn_outputs[turn]):
                raise AssertionError(f"child of trial {trial}, chat {i}, turn {turn}: wrong tokens {out.tolist()}")
            if rng.random() < 0.3:
                bank.offload("cold")
        banks.append(bank)
        while len(banks) > rng.choice([0, 1]):  # at most one idle chat holds its blocks
            banks.pop(0).close()


def _run_writer(model, conversations, cold_dir, trial, error_path):
    try:
        _writer(model, conversations, cold_dir, trial, error_path)
    except BaseException:  # noqa: BLE001
        with open(error_path, "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def test_sigkill_of_a_chatting_writer_leaves_only_intact_reusable_blocks(model, conversations, tmp_path):
    rng = random.Random(2024)
    trials, reusing_trials, reused_blocks, imported = 56, 0, 0, []
    cold_dir = None
    for trial in range(trials):
        if trial % 8 == 0:  # a fresh cold directory now and then; otherwise the last one, reused
            cold_dir = str(tmp_path / f"cold{trial}")
        error_path = str(tmp_path / f"child{trial}.err")
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            _run_writer(model, conversations, cold_dir, trial, error_path)
        time.sleep(rng.uniform(0.02, 0.4))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.path.exists(error_path):
            pytest.fail(f"trial {trial}: the writer failed before it was killed:\n{open(error_path).read()}")
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (trial, status)

        # checked on a copy: the checks compute (and a closing store persists) the follow-ups too,
        # which would raise the verified history later trials on this directory are held to
        check_dir = str(tmp_path / f"check{trial}")
        if os.path.exists(cold_dir):
            shutil.copytree(cold_dir, check_dir)
        store = tiered_kv.TierStore(crash_config(check_dir))
        try:
            bank = tiered_kv.CacheBank(model, store=store)  # binds: imports the durable records
            bank.close()
            assert store.cold_unavailable is None, store.cold_unavailable  # the dead writer's lock is gone
            in_cold = [b for b, entry in store.index.items() if entry.tier == COLD]
            imported.append(len(in_cold))
            assert store.verify(in_cold) == [], f"trial {trial}: imported records fail their checksums"
            assert_within_capacity(store)
            trial_reused = 0
            for conversation in conversations:
                reused, table = check_reattach(model, store, conversation)
                trial_reused += len(table)
                assert_within_capacity(store)
            reused_blocks += trial_reused
            reusing_trials += trial_reused > 0
        finally:
            store.close()
            shutil.rmtree(check_dir, ignore_errors=True)
    print(f"\n{trials} SIGKILL trials: {reusing_trials} reused blocks ({reused_blocks} blocks in all); "
          f"durable records found after each kill: {imported}")
    assert reusing_trials >= trials // 4, (reusing_trials, imported)  # durable blocks did survive kills


# --- bit flips and truncation between processes ------------------------------------------------

def _first_chat_then_slots(model, conversation, cold_dir):
    """A clean first chat (closing moves its blocks to cold, durably); then a second store finds
    where each block of the conversation lies: (file path, record stride, block ids, slots)."""
    bank = tiered_kv.CacheBank(model, crash_config(cold_dir, cold_blocks=64))
    for turn, inputs in enumerate(conversation.turn_inputs):
        assert torch.equal(greedy(model, inputs, bank, TURNS[turn][1]), conversation.turn_outputs[turn])
    bank.close()
    store = tiered_kv.TierStore(crash_config(cold_dir, cold_blocks=64))
    tiered_kv.CacheBank(model, store=store).close()  # bind: import the durable records
    chain = published_chain(store, model, conversation.follow)
    assert len(chain) == conversation.history // BLOCK_SIZE  # every full block came back
    slots = [store.index.get(b).slot for b in chain]
    assert all(store.index.get(b).tier == COLD for b in chain)
    return store, chain, slots


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_flipped_byte_in_a_durable_record_is_never_reused(model, conversations, tmp_path, where):
    conversation, damaged = conversations[0], 3
    store, chain, slots = _first_chat_then_slots(model, conversation, tmp_path / "cold")
    cold = store.tiers[COLD]
    offset = 5 if where == "data" else cold._header_offset + 70  # layer 0's data, or the header's key
    flip_cold_byte(store, chain[damaged], offset)
    store.close()

    store = tiered_kv.TierStore(crash_config(tmp_path / "cold", cold_blocks=64))
    try:
        reused, table = check_reattach(model, store, conversation)
        assert reused == damaged * BLOCK_SIZE  # the intact prefix, never the damaged block
    finally:
        store.close()
    # the damaged record was dropped and the block recomputed: the next process reuses it all
    store = tiered_kv.TierStore(crash_config(tmp_path / "cold", cold_blocks=64))
    try:
        reused, _ = check_reattach(model, store, conversation, history=conversation.follow.shape[1] - 1)
        assert reused == (conversation.follow.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    finally:
        store.close()


def test_a_truncated_block_file_reuses_only_the_records_it_left_whole(model, conversations, tmp_path):
    conversation, cut_at = conversations[1], 4
    store, chain, slots = _first_chat_then_slots(model, conversation, tmp_path / "cold")
    path, stride = store.tiers[COLD].file_path, store.tiers[COLD].record_stride_bytes
    store.close()
    os.truncate(path, slots[cut_at] * stride + 100)  # cuts this record and every later slot
    expected = next(i for i, slot in enumerate(slots) if slot >= slots[cut_at]) * BLOCK_SIZE

    store = tiered_kv.TierStore(crash_config(tmp_path / "cold", cold_blocks=64))
    try:
        reused, table = check_reattach(model, store, conversation)
        assert reused == expected
    finally:
        store.close()


# --- a full disk -------------------------------------------------------------------------------

def test_a_cold_capacity_beyond_a_small_tmpfs_is_a_config_error_and_leaves_no_file(model, tmp_path):
    mount = tmp_path / "mnt"
    why = mount_tmpfs(mount, "256k")
    if why:
        pytest.skip(f"{why}; test_a_cold_capacity_that_cannot_be_preallocated... injects ENOSPC instead")
    try:
        with pytest.raises(ConfigError, match=r"config key 'cold\.capacity'"):
            tiered_kv.CacheBank(model, crash_config(mount / "cold", cold_blocks=1000))  # ~4 MiB on 256 KiB
        assert os.listdir(mount) == []
    finally:
        umount_tmpfs(mount)


def test_a_cold_capacity_that_cannot_be_preallocated_is_a_config_error(model, tmp_path, monkeypatch):
    def full_disk(fd, size_bytes):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(block_io, "preallocate", full_disk)
    with pytest.raises(ConfigError, match=r"config key 'cold\.capacity'.*No space left"):
        tiered_kv.CacheBank(model, crash_config(tmp_path / "cold"))
    assert not os.path.exists(tmp_path / "cold")


def _chat_through_failing_writes(model, conversation, config, fail_writes, restore):
    """Chat `conversation` on one store while `fail_writes()` makes the cold tier's writes fail
    from turn 1 on. Each turn either answers with the reference tokens or raises; a turn that
    raised is retried once in a new bank (attach reuses what is intact). Then `restore()`: a chat on
    the same store, and one in a new store on the same path, reattach it with DynamicCache's tokens.
    Returns (turns answered while writes failed, the errors raised)."""
    errors, answered = [], 0
    store = tiered_kv.TierStore(config)
    try:
        bank = tiered_kv.CacheBank(model, store=store)
        try:
            for turn, inputs in enumerate(conversation.turn_inputs):
                if turn == 1:
                    fail_writes()
                for attempt in range(2):
                    try:
                        if attempt:
                            bank.close()
                            bank = tiered_kv.CacheBank(model, store=store)
                            bank.attach(inputs)
                        out = greedy(model, inputs, bank, TURNS[turn][1])
                    except Exception as error:  # noqa: BLE001  (recorded, checked and reported)
                        errors.append(error)
                        continue
                    assert torch.equal(out, conversation.turn_outputs[turn]), f"turn {turn} served wrong tokens"
                    answered += turn >= 1
                    break
        finally:
            bank.close()
            restore()
        check_reattach(model, store, conversation)  # the same store, after the failures
    finally:
        restore()
        store.close()
    store = tiered_kv.TierStore(config)
    try:
        check_reattach(model, store, conversation, history=conversation.follow.shape[1] - 1)
    finally:
        store.close()
    return answered, errors


def _unclear(errors) -> list[str]:
    """The errors that do not say the disk is full (an OSError with errno ENOSPC, or a message
    saying so): a user could not tell why the chat stopped."""
    unclear = []
    for error in errors:
        text = str(error)
        if not (isinstance(error, OSError) and (error.errno == errno.ENOSPC or "No space left" in text
                                                or "disk is full" in text)):
            unclear.append(f"{type(error).__name__}(errno={getattr(error, 'errno', None)}): {text[-160:]}")
    return unclear


def _report(variant, answered, errors):
    kinds = sorted({f"{type(e).__name__}: {e}"[:200] for e in errors})
    print(f"\n{variant}: {answered} of {len(TURNS) - 1} turns answered (correctly) while writes failed; "
          f"{len(errors)} attempt(s) raised" + (": " + " | ".join(kinds) if kinds else ""))


def test_cold_writes_failing_with_enospc_mid_chat_never_serve_wrong_tokens(model, conversations, tmp_path,
                                                                           monkeypatch):
    """Injected at the I/O wrapper: every pwritev of the cold file fails from turn 1 on."""
    real_pwritev = block_io.os.pwritev

    def full_disk(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    answered, errors = _chat_through_failing_writes(
        model, conversations[2], crash_config(tmp_path / "cold"),
        fail_writes=lambda: monkeypatch.setattr(block_io.os, "pwritev", full_disk),
        restore=lambda: monkeypatch.setattr(block_io.os, "pwritev", real_pwritev))
    _report("injected ENOSPC on cold writes", answered, errors)
    assert _unclear(errors) == []


def test_a_tmpfs_filling_up_mid_chat_never_serves_wrong_tokens(model, conversations, tmp_path):
    """A real full disk: the block file is preallocated at start, then a filler takes every free
    byte of the tmpfs, so what grows later (the sqlite index and its WAL) hits ENOSPC."""
    mount = tmp_path / "mnt"
    why = mount_tmpfs(mount, "1m")
    if why:
        pytest.skip(f"{why}; test_cold_writes_failing_with_enospc_mid_chat... injects ENOSPC instead")
    filler = mount / "filler"

    def fill():
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)

    try:
        answered, errors = _chat_through_failing_writes(
            model, conversations[2], crash_config(mount / "cold", cold_blocks=64),
            fail_writes=fill, restore=lambda: filler.unlink(missing_ok=True))
    finally:
        umount_tmpfs(mount)
    _report("tmpfs full mid-chat", answered, errors)
    assert _unclear(errors) == []  # every error says why (the disk is full), none is vague
