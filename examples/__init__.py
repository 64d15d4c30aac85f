"""Runnable examples on top of the library (import name `lmcached.examples`, folder `examples/`).

What lives here: `demo.py`, what `lmcached demo` runs (worker processes running a real
transformer share prompt prefixes). It sits outside the library core (`lmcached.client`)
but is installed with the package, so `lmcached demo` works after `pip install '.[hf]'`
(in a checkout; `pip install 'lmcached[hf]'` from a package index).

What it may import: anything, `lmcached.client` (engine and hf), `lmcached.launcher`,
`lmcached.wire.protocol`, transformers and tokenizers. Nothing imports it but the CLI's `demo`
command, and that only inside the command, so `lmcached` runs without torch or
transformers for every other command.
"""
