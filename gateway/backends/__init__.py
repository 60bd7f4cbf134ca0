"""The gateway's link to its inference backends.

- ``address``: ``unix:PATH`` / ``tcp://HOST:PORT`` parsing and connecting;
- ``client.BackendClient``: one actor per connection (writer and reader tasks);
- ``request``: ``RequestHandle`` (one request's outputs) and the link's errors (``BackendUnavailable``...);
- ``process.BackendProcess``: one spawned backend: its process group, exit status and relayed stderr (the
  load-error line kept);
- ``supervisor.BackendSupervisor``: spawns or connects one backend, restarts it with backoff, marks the model
  unavailable after repeated failures; a first start that cannot load the model is fatal;
- ``pool.BackendPool``: one model's supervisors; picks a ready, undrained backend per request by the routing
  policy of ``routing`` (prefix-aware rendezvous hashing with a load bound, or least-loaded); operator drains.
"""
