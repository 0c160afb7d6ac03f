"""A Flower Grid whose nodes are fedskew sites in this process: a strategy's `start(grid=...)` runs its rounds
against the very reply functions fedskew's ClientApp handlers call (`train_reply`, `mean_gradient_reply`,
`evaluate_reply`), each node with its own SiteData and its own `context.state` between rounds, as a SuperNode
keeps it. No SuperLink, no serialisation, no Ray: the benchmark's trials run whole federations on one core."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedskew.client_app import evaluate_reply, mean_gradient_reply, train_reply
from fedskew.config import RunConfig
from fedskew.data.sites import SiteData
from fedskew.protocol import GRADIENT_QUERY
from fedskew.site_state import SiteState

RUN_ID = 1
SERVER_NODE_ID = 0

# What a node is sent and what it answered, for every exchange: how a trial observes the rounds.
Observer = Callable[[list[Message], list[Message]], None]


@contextlib.contextmanager
def server_identity() -> Iterator[None]:
    """Flower builds a Message only inside a runtime that has named its run, node and task (outside one:
    "run_id is not set"); this names them for the ServerApp side of an in-process run, and restores what was
    there before."""
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SERVER_NODE_ID, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class SiteGrid(Grid):
    """Nodes 1..N, node k + 1 answering as site `sites[k]`. `round_site(site, server_round)` is the data the site
    trains on in that round (default: the site as given); its validation split always answers evaluation.
    `observers` are called with each exchange's messages and their replies, in order."""

    def __init__(self, cfg: RunConfig, sites: list[SiteData],
                 round_site: Callable[[SiteData, int], SiteData] = lambda site, server_round: site):
        self.cfg, self.sites, self.round_site = cfg, sites, round_site
        self.contexts = {node: Context(run_id=RUN_ID, node_id=node, node_config={}, state=RecordDict(), run_config={})
                         for node in self.get_node_ids()}
        self.observers: list[Observer] = []
        self._run: Run | None = None
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run | None:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> list[int]:
        return list(range(1, len(self.sites) + 1))

    def answer(self, message: Message) -> Message:
        """The site's reply to `message`, from the ClientApp's own reply function for its message type."""
        node, kind, content = message.metadata.dst_node_id, message.metadata.message_type, message.content
        if node not in self.contexts:
            raise ValueError(f"a message for node {node}, but this grid's nodes are {self.get_node_ids()}")
        site = self.sites[node - 1]
        if kind == MessageType.EVALUATE:
            return Message(evaluate_reply(self.cfg, site, content), reply_to=message)
        site = self.round_site(site, int(content["config"]["server-round"]))
        if kind == MessageType.TRAIN:
            return Message(train_reply(self.cfg, site, content, SiteState(self.contexts[node])), reply_to=message)
        if kind == GRADIENT_QUERY:
            return Message(mean_gradient_reply(self.cfg, site, content), reply_to=message)
        raise ValueError(f"message type {kind!r} has no in-process site handler; this grid answers "
                         f"{MessageType.TRAIN}, {MessageType.EVALUATE} and {GRADIENT_QUERY}")

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        replies = [self.answer(message) for message in messages]
        for observer in self.observers:
            observer(messages, replies)
        self._replies.update((message.object_id, reply) for message, reply in zip(messages, replies))
        return [message.object_id for message in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(message_id) for message_id in message_ids if message_id in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        # Every reply is computed while it is pushed: nothing to wait for, whatever the timeout.
        return self.pull_messages(self.push_messages(messages))
