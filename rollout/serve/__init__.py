"""`rollout serve`: an OpenAI-compatible HTTP server over the embedded engine.

protocol.py checks requests into engine terms (every number against the engine's range, every
size before its cost); responses.py shapes the answers (OpenAI's wire format plus the `rollout`
extension: token ids, log-probs, policy version); wire.py is the HTTP/1.1 layer (uvicorn's h11
protocol with every error as OpenAI's JSON, bodies read against a deadline); server.py routes and
answers (an ASGI app on uvicorn, one event loop, server-sent events); recording.py records what an
agent's episode was served; loading.py turns --config / --model / --checkpoint into a loaded
model behind an EngineService. See docs/serve.md.
"""
