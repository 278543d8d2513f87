"""An in-process Flower ``Grid`` that runs a ClientApp directly, one message at a time.

Why: Ray start-up costs 6-8 s and its actors make the order of execution depend on the OS, while a
unit or integration test wants the full ServerApp <-> ClientApp path (real ``Message``,
``RecordDict``, ``Context.state``, the real ClientApp handlers) in a second and deterministically.
On a 2-core laptop running clients one after another with 2 torch threads is also about as fast as
two 1-thread actors (docs/data.md), so ``run.backend=inline`` is a useful no-Ray mode too.

It keeps Flower's semantics that fl-geo relies on: messages to one node run in push order, each
node has its own persistent ``Context``, an exception in a ClientApp becomes an *error reply*, a
node that is removed vanishes from ``get_node_ids()`` and never answers. Hooks let tests tamper
with replies (bad payloads), remove or add nodes mid-run, and silence a node (``silent``: it stays
in ``get_node_ids()`` but its messages wait unanswered until it is taken out of the set again).
"""

from __future__ import annotations

import itertools
import traceback
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

# Flower's error code for an exception raised inside a ClientApp.
CLIENT_APP_RAISED_EXCEPTION = 300

ReplyHook = Callable[[int, Message, Message], Message]


class InlineGrid(Grid):
    """Runs ``client_app`` for each pushed message when its reply is pulled."""

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: dict[str, Any] | None = None,
        node_configs: list[dict[str, Any]] | None = None,
        seed: int = 0,
    ) -> None:
        self.client_app = client_app
        self._run_obj = Run.create_empty(run_id=1)
        # Flower stamps server-created messages with this process's task identity; its own
        # compat runner sets it the same way for an in-process ServerApp.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = self._run_obj.run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        self._run_config = dict(run_config or {})
        self._ids = itertools.count(1_000 + seed * 10_000)
        self.contexts: dict[int, Context] = {}
        self._queue: dict[str, Message] = {}  # message id -> message, in push order
        self._replies: dict[str, Message] = {}
        self.reply_hook: ReplyHook | None = None
        self.executed: list[tuple[int, str]] = []  # (node, message type): what ran, in order
        # Nodes alive but not answering (a hung site): their queued messages are not run.
        self.silent: set[int] = set()
        for i in range(num_nodes):
            cfg = node_configs[i] if node_configs else {"partition-id": i, "num-partitions": num_nodes}
            self.add_node(cfg)

    # ---- membership (test hooks) --------------------------------------------------------------
    def add_node(self, node_config: dict[str, Any]) -> int:
        node_id = next(self._ids)
        self.contexts[node_id] = Context(
            run_id=self._run_obj.run_id,
            node_id=node_id,
            node_config=dict(node_config),
            state=RecordDict(),
            run_config=dict(self._run_config),
        )
        return node_id

    def remove_node(self, node_id: int) -> None:
        """The node dies: it leaves the live set and its queued messages are never answered."""
        self.contexts.pop(node_id, None)

    # ---- Grid API -----------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run_obj = run

    @property
    def run(self) -> Run:
        return self._run_obj

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self.contexts:
                ids.append("")
                continue
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid  # as Flower's own in-memory grid does
            self._queue[mid] = msg
            ids.append(mid)
        return ids

    def _execute(self, mid: str) -> None:
        msg = self._queue.pop(mid)
        node = msg.metadata.dst_node_id
        context = self.contexts.get(node)
        if context is None:  # died after the push: never answers
            return
        self.executed.append((node, msg.metadata.message_type))
        threads = torch.get_num_threads()  # a real ClientApp has its own process: keep ours intact
        try:
            reply = self.client_app(msg, context)
        except Exception as exc:  # noqa: BLE001 - any ClientApp failure becomes an error reply
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
            reply = Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
        finally:
            torch.set_num_threads(threads)
        if self.reply_hook is not None:
            reply = self.reply_hook(node, msg, reply)
        self._replies[mid] = reply

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = set(message_ids)
        # Run queued messages in push order (per node order is what Flower guarantees).
        for mid in [m for m in self._queue if m in wanted]:
            if self._queue[mid].metadata.dst_node_id not in self.silent:
                self._execute(mid)
        out = [self._replies.pop(mid) for mid in list(self._replies) if mid in wanted]
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        return self.pull_messages(ids)
