"""Generation on the CPU executor (``simulate=True``): per-slot continuous batching, sampling with
seeds, streaming, end-of-sequence ids from generation_config.json, stop ids and strings, the chat
template, special tokens in text, and the fp16 -> bf16 cast at load."""
import json
import shutil
import time

import pytest
import torch

from serve_helpers import tiny_checkpoint, tiny_engine
from trtllm_mk.errors import UserError
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.reference import ReferenceDecoder
from trtllm_mk.runtime.hybrid import HybridEngine
from trtllm_mk.sampling import SamplingParams
from trtllm_mk.serve.scheduler import QueueFull, Request, make_request
from trtllm_mk.serve.text import TextStream, apply_chat_template

PROMPTS = [[3, 141, 59, 26, 5, 358, 97, 93, 238, 46], [6, 7, 8, 9], [100, 200, 300]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def engine2(tmp_path_factory, checkpoint):
    d = tiny_engine(tmp_path_factory.mktemp("e2") / "tiny_b2", checkpoint, batch=2)
    eng = HybridEngine(d, weights=checkpoint, simulate=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def solo(engine2):
    """Greedy continuations of each prompt decoded alone (the other slot free)."""
    return [engine2.generate([p], 10, eos_ids=()).tokens[0] for p in PROMPTS]


def test_greedy_matches_the_reference_decoder(engine2, checkpoint, solo):
    w = {k: v.float() for k, v in engine2.weights.items()}
    ref = ReferenceDecoder(engine2.spec, w, compute_dtype=torch.float32)
    for p, got in zip(PROMPTS, solo):
        cache = PagedKVCache.allocate(engine2.spec, 1, 256, 32, dtype=torch.float32)
        assert got == ref.generate([p], 10, cache=cache, eos_ids=())[0]
    assert len({tuple(s) for s in solo}) == len(solo)


def test_each_prompt_in_its_own_slot_decodes_as_if_alone(engine2, solo):
    r = engine2.generate(PROMPTS[:2], 10, eos_ids=())
    assert r.tokens == solo[:2]
    assert len(r.tpot_ms) == 9 and len(r.request_ttft_ms) == 2
    r = engine2.generate(PROMPTS[1:], 10, eos_ids=())   # the same slots, now holding other prompts
    assert r.tokens == solo[1:]


def test_a_request_joins_while_another_decodes(engine2, solo):
    sched = engine2.scheduler
    sched.start()
    long = make_request(engine2, PROMPTS[0], 40, ignore_eos=True)
    sched.submit(long)
    first = next(long.events())          # the long request is decoding now
    assert first.tokens and first.finish_reason is None
    late = [make_request(engine2, p, 10, ignore_eos=True) for p in PROMPTS[1:]]
    for r in late:                       # one takes the free slot, the other waits for it
        sched.submit(r)
    for r in late:
        assert r.result().tokens == solo[PROMPTS.index(r.prompt)]
    assert not long.done.is_set(), "the late requests finished while the long one still decodes"
    assert long.result().tokens[:10] == solo[0]
    assert max(r.t_done for r in late) < long.t_done


def test_sampling_is_reproducible_per_seed_whatever_shares_the_batch(engine2):
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    alone = engine2.generate([PROMPTS[0]], 12, eos_ids=(), sampling=p).tokens[0]
    again = engine2.generate([PROMPTS[0], PROMPTS[0]], 12, eos_ids=(), sampling=p).tokens
    assert again == [alone, alone]
    other = engine2.generate([PROMPTS[0]], 12, eos_ids=(),
                             sampling=SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1235)).tokens[0]
    assert other != alone


def test_temperature_zero_is_the_greedy_path(engine2, solo):
    r = engine2.generate([PROMPTS[2]], 10, eos_ids=(), sampling=SamplingParams(temperature=0.0, seed=9, logprobs=2))
    assert r.tokens[0] == solo[2]


def test_stream_yields_tokens_as_decoded_and_frees_the_slot_when_dropped(engine2, solo):
    text = engine2.tokenizer.decode(solo[1], skip_special_tokens=True)
    events = list(engine2.stream(PROMPTS[1], 10, ignore_eos=True))
    assert len(events) == 10 and [t for e in events for t in e.tokens] == solo[1]
    assert "".join(e.text for e in events) == text
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
    it = engine2.stream(PROMPTS[0], 200, ignore_eos=True)
    next(it)
    it.close()                            # the consumer goes away
    deadline = time.monotonic() + 10
    while engine2.scheduler.busy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine2.scheduler.busy == 0


def test_text_prompt_and_logprobs_through_stream(engine2):
    evs = list(engine2.stream("ba be ko", 4, temperature=0.7, seed=3, logprobs=2))
    lps = [c for e in evs for c in e.logprobs]
    assert len(lps) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= c.top_logprobs[0][1] + 1e-6
                                 for c in lps)


def test_eos_from_generation_config_stops(tmp_path, engine2, checkpoint, solo):
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    stop_at = solo[1][3]
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_at]}))
    eng = HybridEngine(engine2.engine.path, weights=ck, simulate=True)
    assert eng.eos_ids() == {stop_at}
    r = eng.generate([PROMPTS[1]], 10)
    assert r.tokens[0] == solo[1][:solo[1].index(stop_at) + 1] and r.finish_reasons == ["stop"]


def test_stop_token_ids_and_stop_strings(engine2, solo):
    toks = solo[1]
    cut = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])   # a token's first occurrence
    r = make_request(engine2, PROMPTS[1], 10, stop_token_ids=[toks[cut]], ignore_eos=True)
    engine2.scheduler.run([r])
    assert r.result().tokens == toks[:cut + 1] and r.finish_reason == "stop"
    words = engine2.tokenizer.decode(toks, skip_special_tokens=True).split(" ")
    stop = " ".join(words[cut:cut + 2])
    r = make_request(engine2, PROMPTS[1], 10, stop=[stop], ignore_eos=True)
    engine2.scheduler.run([r])
    res = r.result()
    assert res.finish_reason == "stop" and res.text == " ".join(words[:cut]) + " "
    assert stop not in res.text


def test_text_stream_skips_special_tokens_and_holds_back_stop_prefixes(checkpoint):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    ids = tok.encode("ba be ko", add_special_tokens=False)
    s = TextStream(tok)
    out = [s.push(i) for i in [ids[0], 3, ids[1], 2, ids[2]]]    # 3 = <|user|>, 2 = </s>
    assert "".join(out) == "ba be ko" and "<" not in "".join(out)
    s = TextStream(tok, stop=["be ko"])
    assert s.push(ids[0]) == "ba" and s.push(ids[1]) == " " and s.push(ids[2]) == "" and s.stopped
    assert s.text == "ba "
    s = TextStream(tok, stop=["be da"])
    assert [s.push(i) for i in ids] == ["ba", " ", "be ko"] and not s.stopped


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer without merges: a two-byte character is two tokens."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    t = ByteLevelBPETokenizer()
    t.train_from_iterator(["ascii"], vocab_size=257, min_frequency=1000, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=t._tokenizer)


def test_text_stream_ends_an_unfinished_character_as_the_tokenizer_decodes_it():
    tok = _byte_level_tokenizer()
    ids = tok.encode("\u00e9!", add_special_tokens=False)   # é is two byte tokens
    assert len(ids) == 3
    s = TextStream(tok)
    assert [s.push(i) for i in ids] + [s.flush()] == ["", "\u00e9", "!", ""] and s.offsets == [0, 0, 1]
    s = TextStream(tok)   # the request ends after the first byte (an end-of-sequence token or the budget)
    assert s.push(ids[0]) == "" and s.flush() == tok.decode(ids[:1]) == "\ufffd" and s.text == "\ufffd"
    s = TextStream(tok, stop=["!"])   # a stop string held back until the end still stops
    assert s.push(ids[0]) == "" and s.push(ids[1]) == "\u00e9" and s.push(ids[2]) == "" and s.stopped


def test_text_stream_offsets_of_a_character_in_four_byte_tokens():
    # every byte token of U+1F600 starts where the character does: the offsets read while the bytes
    # are held back (what a streamed chunk reports) are the final ones, and they never decrease
    tok = _byte_level_tokenizer()
    ids = tok.encode("a\U0001F600b", add_special_tokens=False)
    assert len(ids) == 6
    s = TextStream(tok)
    streamed = []
    for i in ids:
        s.push(i)
        streamed.append(s.offsets[-1])
    s.flush()
    assert s.text == "a\U0001F600b" and streamed == s.offsets == [0, 1, 1, 1, 1, 2]


def test_text_stream_offsets_and_bytes_of_a_stray_byte_token():
    tok = _byte_level_tokenizer()
    stray = tok.encode("\u00e9", add_special_tokens=False)[1]   # a continuation byte on its own: U+FFFD
    ids = [stray] + tok.encode("le", add_special_tokens=False)
    s = TextStream(tok)
    out = [s.push(i) for i in ids] + [s.flush()]
    assert "".join(out) == s.text == "\ufffdle"
    assert s.offsets == [0, 1, 2]   # "l" starts after the replacement character, not with it
    assert s.token_bytes(stray) == [0xA9] and s.token_bytes(ids[1]) == [ord("l")]   # the byte, not U+FFFD's
    e = tok.encode("\u00e9", add_special_tokens=False)
    assert [b for t in e for b in s.token_bytes(t)] == list("\u00e9".encode())


def test_a_chat_template_that_raises_is_a_user_error(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint(tmp_path)), local_files_only=True)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(UserError, match="chat template refused them: Conversation roles must alternate"):
        apply_chat_template(tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])


def test_id_text_offsets_point_at_each_token():
    from trtllm_mk.serve.text import IdText
    t = IdText()
    assert [t.push(i) for i in (409, 7, 12)] == ["409", " 7", " 12"]
    assert t.text == "409 7 12" and t.offsets == [0, 4, 6]


def test_chat_template_renders_messages_for_the_reply(engine2):
    ids = apply_chat_template(engine2.tokenizer, [{"role": "user", "content": "ba be"}])
    tok = engine2.tokenizer
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.decode(ids, skip_special_tokens=True).split() == ["ba", "be"]


def test_bad_requests_are_user_errors(engine2):
    with pytest.raises(UserError, match="max_input_len"):
        make_request(engine2, [1] * 200, 4)
    with pytest.raises(UserError, match="max_seq_len"):
        make_request(engine2, [1] * 100, 200)
    with pytest.raises(UserError, match="top_p"):
        make_request(engine2, [1, 2], 4, top_p=0)
    with pytest.raises(UserError, match=r"token ids must be in"):
        make_request(engine2, [1, 9999], 4)


def test_a_full_queue_refuses(engine2):
    from trtllm_mk.serve.scheduler import Scheduler
    sched = Scheduler(engine2, max_queue=1)    # not started: nothing leaves the queue
    for _ in range(engine2.batch + 1):         # one per free slot, then one waits for a slot
        sched.submit(Request([1, 2], SamplingParams(), 2))
    with pytest.raises(QueueFull):
        sched.submit(Request([1, 2], SamplingParams(), 2))


def test_fp16_checkpoint_is_cast_to_bf16_with_a_note(tmp_path, engine2, checkpoint, capsys):
    from safetensors.torch import load_file, save_file

    from trtllm_mk.model.spec import load_spec
    from trtllm_mk.runtime.hybrid import _load_weights
    ck = tmp_path / "fp16"
    shutil.copytree(checkpoint, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    (ck / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.half() for k, v in load_file(str(ck / "model.safetensors")).items()},
              str(ck / "model.safetensors"), metadata={"format": "pt"})
    spec = load_spec(ck)
    w = _load_weights(spec, ck, "cpu", 0)
    assert {t.dtype for t in w.values()} == {torch.bfloat16}
    assert "cast to bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize("call,needle", [
    (lambda e: e.generate(["hello"], 4), "generate takes a list of prompts, each a list of token ids"),
    (lambda e: e.generate([["5", "6"]], 4), "a prompt here is a list of token ids"),
    (lambda e: e.generate([[5]], "4"), "max_new_tokens must be an integer"),
    (lambda e: e.generate([[5]], 2.5), "max_new_tokens must be an integer"),
    (lambda e: e.generate([[5.5, 6]], 2), "a prompt here is a list of token ids"),
    (lambda e: e.generate([5, 6, 7], 4), "generate takes a list of prompts, each a list of token ids"),
    (lambda e: list(e.stream(None)), "a prompt is text or a list of token ids"),
    (lambda e: list(e.stream(["sat", "cat"])), "a prompt is text or a list of token ids"),
    (lambda e: list(e.stream([5], seed="x")), "seed must be an integer"),
    (lambda e: list(e.stream([5], max_tokens=2.9)), "max_tokens must be an integer"),
    (lambda e: list(e.stream([5], stop=[""])), "stop is a list of non-empty strings"),
    (lambda e: list(e.stream([5], stop_token_ids=["x", -5])), "stop_token_ids is a list of token ids"),
])
def test_python_api_arguments_are_user_errors(engine2, call, needle):
    with pytest.raises(UserError, match=needle):
        call(engine2)


def test_a_closed_engine_says_so(engine2, checkpoint):
    engine_dir = engine2.engine.path
    eng = HybridEngine(engine_dir, weights=checkpoint, simulate=True)
    eng.close()
    with pytest.raises(UserError, match="the engine is closed"):
        eng.generate([[5]], 2)
    with pytest.raises(UserError, match="the engine is closed"):
        list(eng.stream([5], max_tokens=2))
    for bad in (None, 5):
        with pytest.raises(UserError, match="engine_dir must be a path"):
            HybridEngine(bad)
    with pytest.raises(UserError, match="seed must be an integer"):
        HybridEngine(engine_dir, weights="random", seed="x", simulate=True)
