"""The embedded MQTT broker (amqtt): the zero-setup default for a box with no broker.

Nothing else in edge-queue imports amqtt. amqtt 0.12 speaks MQTT 3.1.1 only, and drops QoS 1
messages sent to a client but not yet acknowledged when that client disconnects (measured;
docs/operations.md, "Install"); a production box should point edge-queue at mosquitto.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Collection
from pathlib import Path
from typing import Any

from edge_queue.config.http import HttpSettings

from .origins import page_origins
from .ws_listener import WsListener, serve_listeners

log = logging.getLogger(__name__)

#: The amqtt version this module is written against (pyproject.toml pins it).
AMQTT_VERSION = "0.12.1"
#: Private names of amqtt's ``Broker`` that the embedded broker overrides (o) or uses (u):
#: amqtt has no public hook for any of these behaviours. tests/test_private_names.py checks
#: every one against the installed amqtt.
AMQTT_PRIVATE: dict[str, str] = {
    "Broker._delete_session": "o: a session deleted only after its client authenticated",
    "Broker._initialize_client_session": "o: a stored session's identity restored when the new client is refused",
    "Broker._handle_client_session": "o: the refused connection answered NOT_AUTHORIZED",
    "Broker._publish_session_retained_messages": "o: kept messages sent without the retain flag",
    "Broker._publish_retained_messages_for_subscription": "o: retained messages for a new subscription only",
    "Broker._get_handler": "u: a session's protocol handler",
    "Broker._subscriptions": "u: topic filter -> subscribed sessions",
    "Broker._sessions": "u: client id -> (session, handler), for the per-client bounds",
    "Broker._authenticate": "u: the authentication plug-ins, run again for a stored session",
    "Broker._tasks_queue": "u: the broadcast tasks, finished ones dropped in any order (forget_finished)",
    "BrokerProtocolHandler._send_packet": "u: a PUBLISH written to the client (in the QoS 1 flow without deadline)",
}


def broker_config(
    host: str,
    port: int,
    *,
    password_file: Path | None = None,
    acl: dict[str, list[str]] | None = None,
    websocket_port: int | None = None,
) -> dict[str, Any]:
    """The amqtt configuration for one TCP listener on ``host:port``, and one MQTT over
    WebSocket listener on ``host:websocket_port`` (for the queue page) when it is given.

    Anonymous clients are allowed unless ``password_file`` (amqtt 0.12's ``user:hash`` lines,
    argon2 or bcrypt hashes made with pwdlib) is given; then client ids beginning with
    ``edge-queue-`` are kept for the user ``edge-queue`` (:class:`~edge_queue.mqtt.amqtt_plugins.ReservedClientIds`).
    ``acl`` maps user names to the topic filters they may publish to.
    """
    plugins: dict[str, Any] = {}
    if password_file is None:
        plugins["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {"allow_anonymous": True}
    else:
        plugins["amqtt.plugins.authentication.FileAuthPlugin"] = {"password_file": str(password_file)}
        plugins["edge_queue.mqtt.amqtt_plugins.ReservedClientIds"] = {"reserved": {"edge-queue-": "edge-queue"}}
    if acl is not None:
        plugins["amqtt.plugins.topic_checking.TopicAccessControlListPlugin"] = {"publish_acl": acl}
    listeners: dict[str, Any] = {"default": {"type": "tcp", "bind": f"{host}:{port}"}}
    if websocket_port is not None:
        listeners["ws"] = {"type": "ws", "bind": f"{host}:{websocket_port}"}
    return {"listeners": listeners, "plugins": plugins}


def load_config(path: Path) -> dict[str, Any]:
    """An amqtt YAML configuration file as a dict. Raises ``ValueError`` naming the file when
    it is not a YAML mapping with a ``listeners.default`` entry."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the amqtt configuration {path}: {e}") from e
    if not isinstance(data, dict) or "default" not in (data.get("listeners") or {}):
        raise ValueError(f"{path}: an amqtt configuration needs listeners.default")
    return data


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


#: Client ids whose stored session a CONNECT being read asks to delete (clean session): deleted
#: only once the CONNECT is authenticated (per connection task: a context variable).
_DEFERRED_DELETES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("deferred", default=None)
#: Session fields amqtt 0.12.1 copies from a CONNECT into the stored session of its client id
#: before it authenticates the CONNECT.
_IDENTITY = ("will_flag", "will_message", "will_topic", "will_qos", "keep_alive", "username", "password")

#: QoS 1 messages sent to one client and not yet acknowledged, at most; the next ones wait, in
#: order, for a PUBACK (mosquitto's ``max_inflight_messages``; amqtt 0.12 has no limit).
INFLIGHT = 1_000


class _Deliveries:
    """One connection's QoS 1 messages awaiting a PUBACK: their futures by packet id, the
    window that bounds them, and when the client last acknowledged one."""

    def __init__(self) -> None:
        self.window = asyncio.Semaphore(INFLIGHT)
        self.waiters: dict[int, asyncio.Future[Any]] = {}
        self.acked_at = time.monotonic()
        self.closed = False


def _handler_class() -> type:
    """amqtt's broker-side protocol handler, with QoS 1 deliveries that wait for their PUBACK.

    amqtt 0.12.1 waits 5 s for the PUBACK of each QoS 1 message it sends (a literal, in
    ``ProtocolHandler._handle_qos1_message_flow``), counted from when the PUBLISH was written to
    the socket: the time the message then spends in socket buffers and in the client's own
    backlog counts. A client behind by more than 5 s of messages (edge-queue itself, which sends
    a request's PUBACK after committing it, under a burst of submits) makes it give up on each:
    a WARNING and an ERROR with a traceback per message, the message dropped from the session
    (it would not be sent again after a reconnect), and a WARNING for each PUBACK that comes
    later. MQTT has no such deadline: a message is sent again only when the connection is
    re-established (MQTT 3.1.1 section 4.4). Here a QoS 1 message waits for its PUBACK for as
    long as its connection lasts, at most :data:`INFLIGHT` per connection are unacknowledged,
    and a client that acknowledges none of them for :data:`SLOW_CONSUMER_S` is disconnected
    (:func:`guard_clients`). When the connection ends, the messages still unacknowledged are
    dropped, as amqtt does (docs/operations.md, "Install").
    """
    from amqtt.mqtt.constants import QOS_1
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import OutgoingApplicationMessage

    class EdgeQueueHandler(BrokerProtocolHandler):  # type: ignore[misc]
        edge_deliveries: _Deliveries | None = None  # set at the first QoS 1 message

        def deliveries(self) -> _Deliveries:
            if self.edge_deliveries is None:
                self.edge_deliveries = _Deliveries()
            return self.edge_deliveries

        async def mqtt_publish(
            self, topic: str, data: bytes | bytearray, qos: int | None, retain: bool, ack_timeout: int | None = None
        ) -> Any:
            if qos != QOS_1 or ack_timeout or self.session is None:
                return await super().mqtt_publish(topic, data, qos, retain, ack_timeout)
            deliveries = self.deliveries()
            async with deliveries.window:
                session = self.session
                message = OutgoingApplicationMessage(None, topic, QOS_1, data, retain)
                if deliveries.closed or session is None:  # the connection ended while it waited
                    return message
                message.packet_id = session.next_packet_id
                if not deliveries.waiters:
                    deliveries.acked_at = time.monotonic()
                waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                deliveries.waiters[message.packet_id] = waiter
                session.inflight_out[message.packet_id] = message
                try:
                    message.publish_packet = message.build_publish_packet()
                    await self._send_packet(message.publish_packet)
                    message.puback_packet = await waiter
                finally:
                    deliveries.waiters.pop(message.packet_id, None)
                    session.inflight_out.pop(message.packet_id, None)
            return message

        async def handle_puback(self, puback: Any) -> None:
            header = puback.variable_header
            waiter = None
            if self.edge_deliveries is not None and header is not None:
                waiter = self.edge_deliveries.waiters.get(header.packet_id)
            if waiter is None or waiter.done():
                await super().handle_puback(puback)
                return
            self.edge_deliveries.acked_at = time.monotonic()  # type: ignore[union-attr]
            waiter.set_result(puback)

        async def stop(self) -> None:
            deliveries = self.edge_deliveries
            if deliveries is not None:
                deliveries.closed = True
                for waiter in deliveries.waiters.values():
                    if not waiter.done():
                        waiter.set_result(None)  # unacknowledged: dropped, as amqtt does
            await super().stop()

    return EdgeQueueHandler


def _broker_class() -> type:
    """amqtt's Broker, with two faults of amqtt 0.12.1 fixed.

    - Retained messages are sent only to their own subscribers. amqtt, on every client connect,
      sends the new client the retained messages that match *any* client's subscriptions (it
      loops over the broker's whole subscription table), so a client subscribed to
      ``phone/replies`` also got every ``<base>/jobs/<id>``. Here a retained message is sent for
      a subscription only when that client holds it.
    - A CONNECT that authentication refuses takes nothing over. amqtt, before it looks at the
      authentication result, deletes the stored session of the CONNECT's client id (with its
      subscriptions and queued messages) when the CONNECT asks for a clean session, or else
      copies the CONNECT's user name, password and Last Will into it and disconnects the
      client connected with that id: any client, with a wrong password or a client id
      reserved for another user (:class:`~edge_queue.mqtt.amqtt_plugins.ReservedClientIds`), could
      leave edge-queue connected but deaf, or knock it off the broker. Here a CONNECT that
      touches a stored session is authenticated first; when refused, the session is left as
      it was and the client only gets its CONNACK "not authorized".
    - Messages kept for a disconnected client are sent to it without the retain flag when it
      comes back (amqtt set it, and edge-queue refuses retained requests): MQTT 3.1.1 section
      3.3.1.3, retain is 0 for a message sent because of an established subscription.
    - QoS 1 messages to a client wait for its PUBACK without a deadline, at most
      :data:`INFLIGHT` at a time (:func:`_handler_class`).
    """
    from amqtt.broker import Broker
    from amqtt.mqtt.connack import NOT_AUTHORIZED, ConnackPacket

    handler_class = _handler_class()

    class EdgeQueueBroker(Broker):  # type: ignore[misc]
        _refused: set[int]

        async def _delete_session(self, client_id: str) -> None:
            deferred = _DEFERRED_DELETES.get()
            if deferred is not None:  # inside _initialize_client_session: after authentication
                deferred.append(client_id)
                return
            await super()._delete_session(client_id)

        async def _publish_session_retained_messages(self, session: Any) -> None:
            handler = self._get_handler(session)
            tasks = []
            if handler:
                while not session.retained_messages.empty():
                    kept = await session.retained_messages.get()
                    tasks.append(
                        asyncio.ensure_future(handler.mqtt_publish(kept.topic, kept.data, kept.qos, retain=False))
                    )
            if tasks:
                await asyncio.wait(tasks)

        async def _publish_retained_messages_for_subscription(self, subscription: Any, session: Any) -> None:
            holders = self._subscriptions.get(subscription[0], [])
            if any(s.client_id == session.client_id for s, _ in holders):
                await super()._publish_retained_messages_for_subscription(subscription, session)

        async def _initialize_client_session(self, reader: Any, writer: Any, *args: Any) -> tuple[Any, Any]:
            saved = {cid: tuple(getattr(s, f) for f in _IDENTITY) for cid, (s, _) in self._sessions.items()}
            deferred: list[str] = []
            token = _DEFERRED_DELETES.set(deferred)
            try:
                handler, session = await super()._initialize_client_session(reader, writer, *args)
            finally:
                _DEFERRED_DELETES.reset(token)
            if type(handler) is handler_class.__base__:
                handler.__class__ = handler_class  # its QoS 1 deliveries: see _handler_class
            old = saved.get(session.client_id)
            touches = (session.parent == 1 and old is not None) or any(c in self._sessions for c in deferred)
            if touches and not await self._authenticate(session, None):
                if session.parent == 1 and old is not None:
                    for field, value in zip(_IDENTITY, old, strict=True):
                        setattr(session, field, value)
                if not hasattr(self, "_refused"):
                    self._refused = set()
                self._refused.add(id(handler))
                return handler, session
            for client_id in deferred:
                await super()._delete_session(client_id)
            return handler, session

        async def _handle_client_session(
            self, reader: Any, writer: Any, session: Any, handler: Any, *args: Any
        ) -> None:
            if id(handler) in getattr(self, "_refused", ()):
                self._refused.discard(id(handler))
                log.warning(
                    "embedded broker: refused a connection with the client id of a stored session, %r: "
                    "its user name or password is not accepted for it",
                    (session.client_id or "")[:64],
                )
                await ConnackPacket.build(0, NOT_AUTHORIZED).to_stream(writer)
                await writer.close()
                return
            await super()._handle_client_session(reader, writer, session, handler, *args)

    return EdgeQueueBroker


#: A connected client whose socket has taken nothing for this long (amqtt's write buffer for it
#: stays above its high-water mark) is disconnected: amqtt keeps every message for a client
#: that never reads, inside edge-queue's process (docs/operations.md, "Load and back-pressure").
SLOW_CONSUMER_S = 2.0
#: Messages amqtt keeps for a disconnected client with a persistent session, at most; the
#: oldest are dropped (mosquitto's ``max_queued_messages``; amqtt has no such limit).
OFFLINE_MESSAGES = 10_000
#: How often clients are checked, in seconds.
CLIENT_CHECK_S = 0.5


def _transport(handler: Any) -> Any:
    """The asyncio transport of an amqtt protocol handler's TCP connection, or ``None``."""
    writer = getattr(getattr(handler, "writer", None), "_writer", None)
    return getattr(writer, "transport", None)


def _stuck(transport: Any, deliveries: _Deliveries | None, now: float) -> bool:
    """Whether a connected client is taking nothing now: its socket takes no more (amqtt's write
    buffer for it is above its high-water mark), or its window of :data:`INFLIGHT` messages is
    full and it acknowledged none of them for :data:`SLOW_CONSUMER_S` (their bytes may all fit
    in the kernel's socket buffers, while the next messages wait in edge-queue's process)."""
    if transport.get_write_buffer_size() >= max(transport.get_write_buffer_limits()[1], 1):
        return True
    return (
        deliveries is not None and len(deliveries.waiters) >= INFLIGHT and now - deliveries.acked_at >= SLOW_CONSUMER_S
    )


def forget_finished(tasks: deque[asyncio.Task[Any]]) -> None:
    """Drop the finished deliveries from amqtt's queue of broadcast tasks (``Broker._tasks_queue``),
    logging a failed one as amqtt does.

    amqtt lets go of a finished task only once every task before it has finished, so one
    delivery waiting for a slow client's PUBACK (edge-queue's own, behind a burst of requests)
    keeps every message sent to every other client since then in memory: at 50,000 submits,
    hundreds of MiB."""
    if not tasks or not any(t.done() for t in tasks):
        return
    waiting = [t for t in tasks if not t.done()]
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            logging.getLogger("amqtt.broker").error(
                "Task failed and will be skipped: %r", task, exc_info=task.exception()
            )
    tasks.clear()
    tasks.extend(waiting)


async def guard_clients(broker: Any, stop: asyncio.Event, trusted: Collection[str] = ()) -> None:
    """Bound what amqtt 0.12 holds per client, until ``stop`` is set: disconnect a connected
    client that took nothing for :data:`SLOW_CONSUMER_S` (:func:`_stuck`; its Last Will, if
    any, is published as for any lost connection), keep at most :data:`OFFLINE_MESSAGES`
    messages for a disconnected one, and :func:`forget_finished`. Uses amqtt's session table
    (``Broker._sessions``: client id -> (session, handler)).

    A client id in ``trusted`` (the service's own, :meth:`BrokerThread.trust`) is never
    disconnected: it takes its requests as fast as it commits them, and amqtt would drop the
    unacknowledged ones with its connection."""
    stuck_since: dict[str, float] = {}
    while not stop.is_set():
        await asyncio.sleep(CLIENT_CHECK_S)
        forget_finished(broker._tasks_queue)
        now = time.monotonic()
        for client_id, (session, handler) in list(broker._sessions.items()):
            transport = _transport(handler)
            if transport is not None and not transport.is_closing():
                if client_id in trusted or not _stuck(transport, getattr(handler, "edge_deliveries", None), now):
                    stuck_since.pop(client_id, None)
                elif now - stuck_since.setdefault(client_id, now) >= SLOW_CONSUMER_S:
                    log.warning(
                        "embedded broker: client %r has read nothing for %.0f s while messages wait for it: "
                        "disconnected",
                        client_id,
                        SLOW_CONSUMER_S,
                    )
                    stuck_since.pop(client_id, None)
                    transport.abort()
                continue
            stuck_since.pop(client_id, None)
            queue = getattr(session, "retained_messages", None)
            if queue is not None and queue.qsize() > OFFLINE_MESSAGES:
                dropped = queue.qsize() - OFFLINE_MESSAGES
                for _ in range(dropped):
                    queue.get_nowait()
                log.warning(
                    "embedded broker: dropped the %d oldest messages kept for disconnected client %r "
                    "(at most %d are kept)",
                    dropped,
                    client_id,
                    OFFLINE_MESSAGES,
                )


class _RoutineNoise(logging.Filter):
    """Drops log lines of amqtt and websockets about events that are routine for edge-queue:
    the MQTT 5 probe of ``mqtt.protocol = "auto"`` (amqtt speaks 3.1.1 and logs each probe as
    an invalid connection, twice), and a browser closing a WebSocket before its handshake ended
    (a 30-line traceback), a port check that connects and closes. Clients refused for their
    credentials are still logged."""

    ROUTINE = (
        "Invalid connection from",
        # a TCP connection closed before it sent anything: a port check (edge-queue up, doctor)
        "No data from",
        "Failed to initialize client session: No data to decode",
        "Failed to initialize client session: Invalid protocol",
        "opening handshake failed",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(r) for r in self.ROUTINE)


#: Lines of one kind (same logger, same text but for numbers) that amqtt and websockets may log
#: at WARNING or above per :data:`BROKER_LOG_WINDOW_S`; the rest are counted, and the count is
#: logged with the first line of that kind in a later window.
BROKER_LINES_LOGGED = 5
BROKER_LOG_WINDOW_S = 60.0


class _Throttle(logging.Filter):
    """At most :data:`BROKER_LINES_LOGGED` lines of each kind per :data:`BROKER_LOG_WINDOW_S`
    (amqtt logs per message, so one fault under load is thousands of lines): each kind of
    fault is still seen, with how often it happened."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[tuple[str, str], list[float]] = {}  # kind -> [window start, logged, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = time.monotonic()
        if len(self.kinds) > 1_000:
            self.kinds.clear()
        kind = (record.name, re.sub(r"\d+", "#", record.getMessage())[:80])
        window = self.kinds.setdefault(kind, [now, 0, 0])
        if now - window[0] >= BROKER_LOG_WINDOW_S:
            if window[2]:
                record.msg = (
                    f"{record.getMessage()} ({window[2]:.0f} more like it not logged in {now - window[0]:.0f} s)"
                )
                record.args = None
            window[:] = [now, 0, 0]
        if window[1] < BROKER_LINES_LOGGED:
            window[1] += 1
            return True
        window[2] += 1
        return False


_NOISE = _RoutineNoise()
_THROTTLE = _Throttle()


def _quiet_loggers() -> None:
    """:class:`_RoutineNoise` and :class:`_Throttle` on the logger of every module of amqtt
    (each logs to ``logging.getLogger(__name__)``, some only once a client connects: made here
    first, with the filters) and websockets' server. A logger's filters do not see its
    children's records, hence one logger per module."""
    import amqtt

    root = Path(amqtt.__file__).parent
    modules = {".".join(("amqtt", *p.relative_to(root).with_suffix("").parts)) for p in root.rglob("*.py")}
    names = {m.removesuffix(".__init__") for m in modules} | {"amqtt.broker.plugins", "websockets.server"}
    for name in names:
        logger = logging.getLogger(name)
        for f in (_NOISE, _THROTTLE):
            if f not in logger.filters:
                logger.addFilter(f)


def _websocket_listeners(broker: Any) -> list[WsListener]:
    """Each ``ws`` listener of ``broker``'s configuration, made one of amqtt's ``external``
    listeners (served by :func:`~edge_queue.mqtt.ws_listener.serve_listeners` instead, with the
    page's origins only): amqtt's own has no ``Origin`` check."""
    from amqtt.contexts import ListenerType

    found = []
    for name, listener in broker.listeners_config.items():
        if listener.type == ListenerType.WS and "bind" in listener:
            fields = ("max_connections", "ssl", "cafile", "capath", "cadata", "certfile", "keyfile")
            found.append(WsListener(name, listener.bind, **{f: getattr(listener, f) for f in fields}))
            listener.type = ListenerType.EXTERNAL
    return found


async def serve(
    config: dict[str, Any],
    stop: asyncio.Event,
    started: threading.Event | None = None,
    trusted: Collection[str] = (),
    page: HttpSettings | None = None,
) -> None:
    """Run an amqtt broker with ``config`` until ``stop`` is set; ``started`` is set once it
    listens. :func:`guard_clients` runs beside it, with ``trusted``. Its WebSocket listeners
    take browsers of the queue page of ``page`` only (``[http]``; default: its defaults)."""
    _quiet_loggers()
    broker = _broker_class()(config)
    websockets = _websocket_listeners(broker)
    await broker.start()
    try:
        servers = await serve_listeners(websockets, broker.ws_connected, page_origins(page or HttpSettings()))
    except BaseException:
        await broker.shutdown()
        raise
    guard = asyncio.create_task(guard_clients(broker, stop, trusted))
    if started is not None:
        started.set()
    for name, listener in config["listeners"].items():
        if isinstance(listener, dict) and "bind" in listener:
            log.info("embedded broker listening on %s (%s, listener %s)", listener["bind"], listener.get("type"), name)
    try:
        await stop.wait()
    finally:
        guard.cancel()
        for server in servers:
            server.close()
            await server.wait_closed()
        await broker.shutdown()
        log.info("embedded broker stopped")


class BrokerThread:
    """The embedded broker on its own event loop thread, for ``edge-queue up``.

    ``start()`` returns once the listener accepts connections; raises ``RuntimeError`` when it
    cannot bind within ``timeout_s``. ``page``: the queue page whose browser pages its
    WebSocket listeners take (:func:`serve`).
    """

    def __init__(self, config: dict[str, Any], page: HttpSettings | None = None) -> None:
        self.config = config
        self.page = page
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="embedded-broker", daemon=True)
        self._error: BaseException | None = None
        self._started = threading.Event()
        #: client ids never disconnected as slow consumers (:func:`guard_clients`)
        self.trusted: set[str] = set()

    def trust(self, client_id: str) -> None:
        """Never disconnect ``client_id`` as a slow consumer: the service of ``edge-queue up``
        (its id ends with a secret nobody else knows)."""
        self.trusted.add(client_id)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._stop = asyncio.Event()
        try:
            loop.run_until_complete(serve(self.config, self._stop, self._started, self.trusted, self.page))
        except BaseException as e:  # reported to start() / logged; the thread must not raise
            self._error = e
            log.exception("embedded broker failed")
        finally:
            loop.close()

    def start(self, timeout_s: float = 10.0) -> None:
        bind = self.config["listeners"]["default"]["bind"]
        self._thread.start()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self._thread.is_alive():
            if self._started.wait(0.05):
                return
        raise RuntimeError(f"embedded broker did not listen on {bind}: {self._error or 'timed out'}")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
