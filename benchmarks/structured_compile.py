"""Grammar compile time and per-token mask time for a JSON schema (default: the 20-field
benchmarks/structured_schema.json) over a model's tokenizer, with the engine's compiler
(nanovllm/structured/compiler.py: xgrammar, a thread pool, a (kind, spec) cache).

    python benchmarks/structured_compile.py                    # the embedded SmolLM2 (49k tokens)
    python benchmarks/structured_compile.py /models/Qwen3-8B   # a model directory or .gguf file
    python benchmarks/structured_compile.py --vocab 150000     # the tokenizer grown to 150k tokens
    python benchmarks/structured_compile.py --llguidance       # llguidance's figures beside xgrammar's

Prints the tokenizer tables' build time (once per engine), the first compile (cold), the
same schema again (the cache), the mask + advance time per token while walking a
schema-valid document, and a mask's time in narrow states (keys, punctuation, enums, numbers)
and in wide ones (inside a free string), where it allows at least half the vocabulary.
--vocab N adds merged tokens (pairs of existing ones) to a byte-level BPE tokenizer until it
has N, for a 150k-vocabulary measurement without a hub.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

SCHEMA_FILE = Path(__file__).with_name("structured_schema.json")
DOCUMENT = {
    "name": "Alexandra", "city": "Marseille", "country": "France", "age": 34, "height_cm": 172.5,
    "email": "alex@mail.com", "active": True, "tags": ["travel", "music"], "score": 0.75, "level": "high",
    "address": {"street": "Rue de la Paix", "zip": "13001"}, "phone": "+33 612 3456", "title": "Engineer",
    "year": 2024, "verified": False, "languages": ["fr", "en"], "company": "Acme Corp", "role": "engineer",
    "rating": 4, "notes": "prefers morning meetings",
}


def grown(tokenizer, size: int):
    """A byte-level BPE tokenizer with merged tokens added until it has `size` tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    rng = random.Random(0)
    pieces = [k for k in vocab if len(k) > 1][:20000]
    n = len(vocab)
    while n < size:
        a, b = rng.choice(pieces), rng.choice(pieces)
        if a + b not in vocab:
            vocab[a + b] = n
            n += 1
            merges.append([a, b] if isinstance(merges[0], list) else f"{a} {b}")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token=tokenizer.eos_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="model directory or .gguf (default: the embedded one)")
    parser.add_argument("--schema", default=str(SCHEMA_FILE))
    parser.add_argument("--vocab", type=int, default=None, help="grow the tokenizer to this many tokens")
    parser.add_argument("--llguidance", action="store_true", help="also measure llguidance (pip install llguidance)")
    parser.add_argument("--save-tokenizer", metavar="DIR", default=None,
                        help="save the (grown) tokenizer to DIR, e.g. beside a random checkpoint's weights")
    args = parser.parse_args()

    from nanovllm.engine.grammars import NARROW_FRACTION
    from nanovllm.loaders.source import resolve_model
    from nanovllm.sampling_params import StructuredOutputsParams
    from nanovllm.structured.compiler import GrammarCompiler
    from nanovllm.structured.matcher import SequenceMatcher, allowed_token_ids

    source = resolve_model(args.model)
    tokenizer = source.tokenizer()
    eos = source.eos_token_ids(tokenizer)
    if args.vocab:
        tokenizer = grown(tokenizer, args.vocab)
    vocab = max(len(tokenizer), source.hf_config.vocab_size if not args.vocab else 0)
    if args.save_tokenizer:
        getattr(tokenizer, "transformers_tokenizer", tokenizer).save_pretrained(args.save_tokenizer)
    schema = json.loads(Path(args.schema).read_text())
    spec = StructuredOutputsParams(json=schema)
    ids = tokenizer.encode(json.dumps(DOCUMENT, ensure_ascii=False), add_special_tokens=False)
    print(f"vocabulary {vocab}, schema {Path(args.schema).name} ({len(schema.get('properties', {}))} fields), "
          f"document {len(ids)} tokens")

    t = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, eos)
    compiler.wait_ready()
    print(f"xgrammar   tokenizer tables {1e3 * (time.perf_counter() - t):8.1f} ms (once per engine)")
    t = time.perf_counter()
    compiled = compiler.submit(spec).result()
    print(f"xgrammar   compile          {1e3 * (time.perf_counter() - t):8.1f} ms")
    times = []
    for _ in range(5):
        t = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=json.dumps(schema))).result()
        times.append(time.perf_counter() - t)
    print(f"xgrammar   cached           {1e3 * statistics.median(times):8.3f} ms")
    matcher = SequenceMatcher(compiled, eos)
    mask = matcher.new_mask()
    t = time.perf_counter()
    for token in ids:
        matcher.fill(mask)
        if not matcher.accept(token):
            raise SystemExit(f"the document does not follow the schema at token {token}")
    matcher.fill(mask)
    print(f"xgrammar   mask + advance   {1e6 * (time.perf_counter() - t) / len(ids):8.1f} us/token "
          f"(done: {matcher.done(mask)})")
    # The same walk, each fill timed (the best of 20) and sorted by how much of the vocabulary
    # its mask allows: the engine skips the masks of wide states where it can (engine/grammars.py).
    by_width = {"narrow": [], "wide": []}
    matcher = SequenceMatcher(compiled, eos)
    for token in ids:
        best = float("inf")
        for _ in range(20):
            t = time.perf_counter()
            matcher.fill(mask)
            best = min(best, time.perf_counter() - t)
        allowed = len(allowed_token_ids(mask))
        by_width["wide" if allowed >= NARROW_FRACTION * vocab else "narrow"].append(best)
        matcher.accept(token)
    for width, times in by_width.items():
        if times:
            print(f"xgrammar   {width + ' mask':15s}  {1e6 * statistics.median(times):8.1f} us median "
                  f"({len(times)} of the document's tokens)")
    compiler.shutdown()

    if args.llguidance:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        t = time.perf_counter()
        lltok = llguidance.hf.from_tokenizer(tokenizer, vocab)
        print(f"llguidance tokenizer tables {1e3 * (time.perf_counter() - t):8.1f} ms")
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(lltok, grammar)
        print(f"llguidance compile          {1e3 * (time.perf_counter() - t):8.1f} ms")
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        t = time.perf_counter()
        for token in ids:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            if not matcher.consume_token(token):
                raise SystemExit(f"llguidance refused token {token}: {matcher.get_error()}")
        print(f"llguidance mask + advance   {1e6 * (time.perf_counter() - t) / len(ids):8.1f} us/token")


if __name__ == "__main__":
    main()
