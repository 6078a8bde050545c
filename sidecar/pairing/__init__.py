"""Which model drafts for which: the one home of pairing advice.

- `rules`: llama.cpp's compatibility rules over vocabulary facts (engine.llama.VocabInfo, the one type);
- `vocab`: those facts and a digest of the token texts read from a GGUF header, and the one
  vocabulary identity (`vocab_id`);
- `catalog`: every model in the stores from its files alone, matched up by the rules;
- `ranking`: the order the files' facts predict;
- `probe`: agreement measured with the engine's Decoder, priced as the schedule prices a round;
- `costs`: what serving measured, which prices a probe's agreement where it exists;
- `suggest` and `auto`: `sidecar suggest`, `draft: auto` and `auto: true`.

It sits above the engine, the model stores, the config and the templates, and below the runtime:
nothing under it imports it (tests/test_layers.py).
"""
