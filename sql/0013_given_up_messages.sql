-- The messages a handler sends when idem gives up on a message (a
-- rejection to the payer, a fault notice: `Handler::given_up`) are written
-- to the outbox in the transaction that records the dead letter in the
-- index, once per death: a row here claims the right to write them, as a
-- consume record claims an event's effect. The death is the letter's key
-- and how often the message was replayed before it died: a copy that dies
-- again (the worker stopped before the broker heard of the first death, or
-- a second copy of the event) finds its row and writes nothing; one that
-- dies again after a replay writes anew. `prune` removes the rows older
-- than its window.
CREATE TABLE mq_given_up (
    consumer_group VARCHAR(64)  COLLATE "C" NOT NULL,
    letter_key     VARCHAR(200) COLLATE "C" NOT NULL,
    replays        INTEGER      NOT NULL,
    given_up_at    TIMESTAMPTZ  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, letter_key, replays)
);

CREATE INDEX mq_given_up_by_time ON mq_given_up (given_up_at);
