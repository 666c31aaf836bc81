"""Guard: the HTTP server both servers run (ref_server.py's and the weight publisher's), hardened
against faulty and hostile peers: waitress with bounded threads and backlog, idle, stalled and
trickling connections closed, a stop that frees the port, JSON error pages, the token check, and a
warning when a server is reachable beyond loopback unguarded (docs/server.md lists the limits).

    python -m pytest tests/test_server.py -k "stalled or port"   # its limits, over HTTP
"""
import hmac
import json
import sys
import threading
import time


def token_ok(authorization: str, token: str) -> bool:
    """Whether the raw Authorization header carries the REF_TOKEN ("" = no auth), compared in
    constant time. Raw bytes: a header that is not UTF-8 is simply wrong, not a crash."""
    expected = f"Bearer {token}".encode()
    return not token or hmac.compare_digest(authorization.encode("latin-1"), expected)


def exposure_warning(host: str, token: str, what: str = "upload and read batches") -> str | None:
    """A warning when a server (the reference server, the weight publisher) is reachable beyond this
    machine with no token to guard it; `what` says what anyone could then do."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.") or token:
        return None
    return f"WARNING: serving on {host} without REF_TOKEN: anyone who reaches this port can {what}"


def warn_if_exposed(host: str, token: str, what: str = "upload and read batches"):
    """Print exposure_warning on stderr when there is one."""
    warning = exposure_warning(host, token, what)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def start_http(app, host, port, *, threads, backlog, idle_timeout, max_body, request_deadline=None,
               per_address=0):
    """Serve the WSGI `app` on a daemon thread; returns stop(), which ends the loop and frees the
    port. A request (headers and body) must arrive whole within request_deadline seconds of its
    first byte (default idle_timeout), so no client holds one of the `backlog` connections long.
    per_address: connections one IP address may hold at once (0 = any number); one more is closed
    as it is accepted, so a peer's idle or trickling connections leave the others' room."""
    from waitress.channel import HTTPChannel
    from waitress.parser import HTTPRequestParser
    from waitress.server import create_server

    class TimedParser(HTTPRequestParser):  # remembers when its request's first byte came
        def __init__(self, adj):
            super().__init__(adj)
            self.began = time.monotonic()

    class TimedChannel(HTTPChannel):
        parser_class = TimedParser

    httpd = create_server(app, host=host, port=port, threads=threads, backlog=backlog,
                          connection_limit=backlog, channel_timeout=idle_timeout,
                          cleanup_interval=1, asyncore_use_poll=True,  # select() dies past fd 1024
                          max_request_body_size=max_body, ident="ref_server")
    httpd.channel_class = TimedChannel
    accept_one = httpd.handle_accept

    def handle_accept():  # guard: no address holds more than per_address of the connections
        if not per_address:
            return accept_one()
        try:
            accepted = httpd.accept()
        except OSError:  # the peer left before its accept: nothing to serve
            return
        if accepted is None:
            return
        conn, addr = accepted
        held = sum(1 for channel in list(httpd.active_channels.values())
                   if channel.addr and channel.addr[0] == addr[0])
        if held >= per_address:
            conn.close()
            return
        httpd.set_socket_options(conn)
        httpd.channel_class(httpd, conn, httpd.fix_addr(addr), httpd.adj, map=httpd._map)

    httpd.handle_accept = handle_accept
    deadline = request_deadline or idle_timeout
    idle_cleanup = httpd.maintenance

    def maintenance(now):  # each second: idle channels, then requests past their deadline
        idle_cleanup(now)
        for channel in list(httpd.active_channels.values()):
            request = getattr(channel, "request", None)
            if isinstance(request, TimedParser) and time.monotonic() - request.began > deadline:
                channel.will_close = True

    httpd.maintenance = maintenance
    stopping = threading.Event()

    def run():
        try:
            httpd.run()
        except OSError:  # stop() closed the sockets under its select(): the end, not an error
            if not stopping.is_set():
                raise

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()

    def stop():
        stopping.set()
        httpd.task_dispatcher.shutdown()
        close_sockets(httpd)
        thread.join(timeout=10)

    return stop


def close_sockets(httpd):
    """Close every socket of a waitress server, the listening one too: its loop ends, the port is
    free. waitress has no public call for it; its private socket map missing is an error
    (tests/test_server.py checks it)."""
    sockets = getattr(httpd, "_map", None)
    if not isinstance(sockets, dict) or not sockets:
        raise RuntimeError(f"waitress {type(httpd).__name__} has no socket map: "
                           "features/http_server.close_sockets needs updating for this waitress "
                           "version")
    for channel in list(sockets.values()):
        channel.close()


def json_errors(app):
    """The bottle `app` with its own error pages (bad request, unknown path or method, a crash) as
    JSON, like every other answer of the server; returns it."""
    import bottle

    def json_error(err):
        bottle.response.content_type = "application/json"
        return json.dumps({"error": f"{err.status}: {err.body}"})

    for status in (400, 404, 405, 500):
        app.error(status)(json_error)
    return app
