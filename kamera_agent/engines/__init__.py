"""kamera inside a serving engine: the engine retains its scheduler, pool and prefix cache, and
kamera's store serves chunk KV past the engine's own prefix hit.

- `synthesis`: which chunks after an engine's prefix hit the store can serve, in which state,
  and capturing what a prefill computed (engine-neutral);
- `lifecycle`: what every adapter does at each step of a request's life (plan, write the pieces,
  capture, count, report), called from the engine's hooks;
- `chunking`: a request's tokens cut into chunks as a window cuts what it is given;
- `slots`: the small protocol an engine's KV pool implements (slots in and out as position-free
  chunk KV, relocated on the way in);
- `stores`: the stores an engine process opens from settings, one per model and settings;
- `sglang`, `vllm`: the adapters (a radix-cache backend, a KV connector).

Engines never import the window: a window and an engine meet only in the store, where one key
and state scheme lets each serve what the other captured.
"""
