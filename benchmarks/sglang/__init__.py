"""The SGLang HiCache storage backend, measured against SGLang's own file backend."""
