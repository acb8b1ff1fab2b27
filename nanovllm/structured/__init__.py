"""Structured output: the output follows a JSON schema, a regex, a choice or a GBNF grammar.

The grammar engine is xgrammar. The flow, top to bottom:
- grammar.py: a `StructuredOutputsParams` -> an xgrammar `Grammar` (checks the spec: a
  ValueError naming the field; milliseconds, so it runs where the request is added).
- compiler.py: Grammar -> CompiledGrammar (the per-token mask tables for this tokenizer), in a
  thread pool with a cache keyed by (kind, spec text); a request waits for its grammar, others
  do not.
- matcher.py: one matcher per sequence, advanced with every accepted token; it keeps the
  bitmask of the tokens allowed next and says when the grammar is done.
- bitmask.py: applies the batch's bitmask rows to the logits on the device, in one launch.
"""
