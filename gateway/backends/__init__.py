"""The gateway's link to its inference backends.

- ``address``: ``unix:PATH`` / ``tcp://HOST:PORT`` parsing and connecting;
- ``client.BackendClient``: one actor per connection (writer and reader tasks);
- ``request``: ``RequestHandle`` (one request's outputs) and the link's errors (``BackendUnavailable``...);
- ``supervisor.BackendSupervisor``: spawns or connects one backend, restarts it when it dies;
- ``pool.BackendPool``: all supervisors; picks the least-loaded ready backend per request.
"""
