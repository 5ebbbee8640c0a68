//! Transfer handlers for `check` to judge: one that is right, and six
//! that are each wrong in a way a team writes in good faith, each caught
//! by the run of `check` named on it. Read them beside `examples/wallet`,
//! which is right.
//!
//! Every handler debits one account, credits another that may not go
//! below zero, and logs the transfer (`transfer_log`), in batches.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use idem::handler::{
    Handler, HandlerError, Invalid, Migration, Outbox, OutboxMessage, Transaction,
};

/// `{"eventId": "t-1", "from": "acct-1", "to": "acct-2", "amount": 10}`
#[derive(Debug, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Transfer {
    pub(crate) event_id: String,
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) amount: i64,
}

/// Accounts that may not go below zero, and one log row per transfer.
pub(crate) const WALLET: &[Migration] = &[Migration {
    version: 1,
    name: "0001_wallet.sql",
    sql: "CREATE TABLE account (id TEXT COLLATE \"C\" PRIMARY KEY, \
                                balance BIGINT NOT NULL CHECK (balance >= 0)); \
          CREATE TABLE transfer_log (event_id TEXT COLLATE \"C\" NOT NULL, \
                                     from_account TEXT NOT NULL, to_account TEXT NOT NULL, \
                                     amount BIGINT NOT NULL, applied_at TIMESTAMPTZ)",
}];

pub(crate) fn decode(body: &[u8]) -> Result<Transfer, Invalid> {
    let transfer: Transfer = serde_json::from_slice(body)?;
    if transfer.amount <= 0 || transfer.from == transfer.to {
        return Err(Invalid::new(
            "a transfer moves a positive amount between two accounts",
        ));
    }
    Ok(transfer)
}

/// Debits `from`, credits `to`, in the transaction; an unknown account can
/// never apply.
async fn move_money(tx: &Transaction<'_>, transfer: &Transfer) -> Result<(), HandlerError> {
    let step = tx
        .prepare_cached("UPDATE account SET balance = balance + $2 WHERE id = $1")
        .await?;
    let (first, second) = ordered(transfer);
    for (account, amount) in [first, second] {
        if tx.execute(&step, &[&account, &amount]).await? != 1 {
            return Err(HandlerError::permanent(format!("no account {account}")));
        }
    }
    Ok(())
}

/// Locks every account of `transfers`, in the accounts' order: batches in
/// flight at once then never wait on each other in a circle.
async fn lock(tx: &Transaction<'_>, transfers: &[&Transfer]) -> Result<(), HandlerError> {
    let accounts: Vec<&str> = transfers
        .iter()
        .flat_map(|t| [t.from.as_str(), t.to.as_str()])
        .collect();
    let lock = tx
        .prepare_cached("SELECT id FROM account WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .await?;
    tx.query(&lock, &[&accounts]).await?;
    Ok(())
}

/// Locks the accounts, then makes each transfer in turn, in the order given.
async fn each_in_turn(tx: &Transaction<'_>, transfers: &[&Transfer]) -> Result<(), HandlerError> {
    lock(tx, transfers).await?;
    for transfer in transfers {
        move_money(tx, transfer).await?;
    }
    Ok(())
}

/// The two legs of a transfer, in the accounts' order (so that two
/// transactions lock them in one order).
fn ordered(transfer: &Transfer) -> ((&str, i64), (&str, i64)) {
    let debit = (transfer.from.as_str(), -transfer.amount);
    let credit = (transfer.to.as_str(), transfer.amount);
    if debit.0 < credit.0 {
        (debit, credit)
    } else {
        (credit, debit)
    }
}

async fn log(
    tx: &Transaction<'_>,
    transfers: &[&Transfer],
    stamped: bool,
) -> Result<(), HandlerError> {
    let sql = if stamped {
        "INSERT INTO transfer_log VALUES ($1, $2, $3, $4, now())"
    } else {
        "INSERT INTO transfer_log VALUES ($1, $2, $3, $4, NULL)"
    };
    let insert = tx.prepare_cached(sql).await?;
    for t in transfers {
        tx.execute(&insert, &[&t.event_id, &t.from, &t.to, &t.amount])
            .await?;
    }
    Ok(())
}

/// A transfer handler whose `apply` is `body`, with the handler, the
/// transaction, the batch's transfers and the outbox named as given; each
/// transfer it makes sends `transfer.completed`.
macro_rules! transfer_handler {
    ($name:ident, |$this:ident, $tx:ident, $transfers:ident, $outbox:ident| $body:block) => {
        impl Handler for $name {
            type Event = Transfer;
            const NAME: &'static str = "wallet";
            const MIGRATIONS: &'static [Migration] = WALLET;
            const SENDS_MESSAGES: bool = true;

            fn decode(&self, body: &[u8]) -> Result<Transfer, Invalid> {
                decode(body)
            }

            fn event_id<'e>(&self, transfer: &'e Transfer) -> &'e str {
                &transfer.event_id
            }

            /// Every transfer made says so, through the outbox.
            fn outgoing(&self, transfer: &Transfer) -> Vec<OutboxMessage> {
                let body = serde_json::to_vec(transfer).unwrap_or_default();
                vec![OutboxMessage::json(
                    "wallet.events",
                    "transfer.completed",
                    body,
                )]
            }

            async fn apply(
                &self,
                tx: &Transaction<'_>,
                transfers: &[&Transfer],
                outbox: &mut Outbox<'_>,
            ) -> Result<(), HandlerError> {
                let ($this, $tx, $transfers, $outbox) = (self, tx, transfers, outbox);
                $body
            }
        }
    };
}

/// Right: locks the batch's accounts in order, then makes each transfer in
/// turn, in the order given.
pub(crate) struct Wallet;
transfer_handler!(Wallet, |_this, tx, transfers, _outbox| {
    each_in_turn(tx, transfers).await?;
    log(tx, transfers, false).await
});

/// Wrong: sums the batch per account and moves the net (one balance check
/// a batch); a batch holding `a → b 10` and `b → a 10` on two empty
/// accounts passes whole, though neither transfer passes alone. Caught by
/// batch equivalence, and by every batch-mode run on one worker.
pub(crate) struct Netting;
transfer_handler!(Netting, |_this, tx, transfers, _outbox| {
    lock(tx, transfers).await?;
    let mut net = BTreeMap::<&str, i64>::new();
    for t in transfers {
        *net.entry(&t.from).or_default() -= t.amount;
        *net.entry(&t.to).or_default() += t.amount;
    }
    let (accounts, deltas): (Vec<&str>, Vec<i64>) = net.into_iter().unzip();
    let update = tx
        .prepare_cached(
            "UPDATE account SET balance = balance + d.delta \
                 FROM unnest($1::text[], $2::bigint[]) AS d(id, delta) WHERE account.id = d.id",
        )
        .await?;
    tx.execute(&update, &[&accounts, &deltas]).await?;
    log(tx, transfers, false).await
});

/// Wrong: logs each transfer through a connection of its own (to the
/// database at this URL), outside idem's transaction, as a call to another
/// service would: committed even when idem's transaction is not. Caught
/// doubled by "killed before commit".
pub(crate) struct OwnConnection {
    pub(crate) database_url: String,
}
transfer_handler!(OwnConnection, |this, tx, transfers, _outbox| {
    each_in_turn(tx, transfers).await?;
    let schema: String = tx
        .query_one("SELECT current_schema()::text", &[])
        .await?
        .get(0);
    let (client, connection) =
        tokio_postgres::connect(&this.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute(&format!("SET search_path TO {schema}"))
        .await?;
    for t in transfers {
        client
            .execute(
                "INSERT INTO transfer_log VALUES ($1, $2, $3, $4, NULL)",
                &[&t.event_id, &t.from, &t.to, &t.amount],
            )
            .await?;
    }
    Ok(())
});

/// Wrong: stamps each log row with the clock, which no run repeats. Caught
/// by the second reference ("differs from itself"); passes once the team
/// leaves the column out (`--ignore-column transfer_log.applied_at`).
pub(crate) struct Stamped;
transfer_handler!(Stamped, |_this, tx, transfers, _outbox| {
    each_in_turn(tx, transfers).await?;
    log(tx, transfers, true).await
});

/// Wrong: says how many transfers it made in one message per call, under
/// the first transfer's key: a batch sends one, its transfers one at a time
/// send one each. Caught by batch equivalence, and by the batch-mode runs.
pub(crate) struct Summarizing;
transfer_handler!(Summarizing, |_this, tx, transfers, outbox| {
    each_in_turn(tx, transfers).await?;
    log(tx, transfers, false).await?;
    let summary = format!("{{\"transfers\": {}}}", transfers.len()).into_bytes();
    let message = OutboxMessage::json("wallet.events", "transfers.made", summary);
    outbox.send(&transfers[0].event_id, message)
});

/// Wrong: writes balances computed from what it cached of them, so that a
/// second worker's transfers (or a transaction rolled back) are lost.
/// Caught by "2 workers sharing the load" (the invariant), and by the
/// reference differing from itself when it is made once for both.
#[derive(Default)]
pub(crate) struct Cached {
    balances: Mutex<HashMap<String, i64>>,
}
transfer_handler!(Cached, |this, tx, transfers, _outbox| {
    this.transfer(tx, transfers).await
});

impl Cached {
    async fn balance(&self, tx: &Transaction<'_>, account: &str) -> Result<i64, HandlerError> {
        let cached = self
            .balances
            .lock()
            .ok()
            .and_then(|b| b.get(account).copied());
        match cached {
            Some(balance) => Ok(balance),
            None => Ok(tx
                .query_one("SELECT balance FROM account WHERE id = $1", &[&account])
                .await?
                .get(0)),
        }
    }

    async fn transfer(
        &self,
        tx: &Transaction<'_>,
        transfers: &[&Transfer],
    ) -> Result<(), HandlerError> {
        lock(tx, transfers).await?;
        let set = tx
            .prepare_cached("UPDATE account SET balance = $2 WHERE id = $1")
            .await?;
        for transfer in transfers {
            let (first, second) = ordered(transfer);
            for (account, amount) in [first, second] {
                let balance = self.balance(tx, account).await? + amount;
                tx.execute(&set, &[&account, &balance]).await?;
                if let Ok(mut balances) = self.balances.lock() {
                    balances.insert(account.to_owned(), balance);
                }
            }
        }
        log(tx, transfers, false).await
    }
}

/// Wrong: announces each transfer itself, with a channel of its own, from
/// `apply` (as a team that publishes with lapin where the outbox belongs):
/// sent whether or not idem's transaction commits, and again when it runs
/// again. Caught by every step: "sent outside idem's outbox".
pub(crate) struct Publishing {
    amqp_url: String,
    exchange: String,
    channel: tokio::sync::OnceCell<lapin::Channel>,
}

impl Publishing {
    /// Publishing to `exchange` on the broker at `amqp_url`.
    pub(crate) fn to(amqp_url: &str, exchange: &str) -> Self {
        Self {
            amqp_url: amqp_url.to_owned(),
            exchange: exchange.to_owned(),
            channel: tokio::sync::OnceCell::new(),
        }
    }
}

impl Handler for Publishing {
    type Event = Transfer;
    const NAME: &'static str = "wallet";
    const MIGRATIONS: &'static [Migration] = WALLET;

    fn decode(&self, body: &[u8]) -> Result<Transfer, Invalid> {
        decode(body)
    }

    fn event_id<'e>(&self, transfer: &'e Transfer) -> &'e str {
        &transfer.event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        transfers: &[&Transfer],
        _outbox: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        each_in_turn(tx, transfers).await?;
        log(tx, transfers, false).await?;
        let channel = self
            .channel
            .get_or_try_init(|| async {
                let connection = lapin::Connection::connect(
                    &self.amqp_url,
                    lapin::ConnectionProperties::default(),
                )
                .await?;
                connection.create_channel().await
            })
            .await
            .map_err(HandlerError::infrastructure)?;
        for transfer in transfers {
            let body = serde_json::to_vec(transfer).map_err(HandlerError::message)?;
            channel
                .basic_publish(
                    self.exchange.as_str().into(),
                    "transfer.completed".into(),
                    lapin::options::BasicPublishOptions::default(),
                    &body,
                    lapin::BasicProperties::default(),
                )
                .await
                .map_err(HandlerError::infrastructure)?;
        }
        Ok(())
    }
}

/// Wrong: reads each balance, then writes the new one, without locking the
/// row first (a read-modify-write): two transactions that read the same
/// balance both write theirs, and one transfer is lost. Caught by "2
/// workers sharing the load" (the invariant, the rows), where two batches
/// touch one account at once.
pub(crate) struct Unlocked;
transfer_handler!(Unlocked, |_this, tx, transfers, _outbox| {
    let read = tx
        .prepare_cached("SELECT balance FROM account WHERE id = $1")
        .await?;
    let write = tx
        .prepare_cached("UPDATE account SET balance = $2 WHERE id = $1")
        .await?;
    for transfer in transfers {
        let (first, second) = ordered(transfer);
        for (account, amount) in [first, second] {
            let Some(row) = tx.query_opt(&read, &[&account]).await? else {
                return Err(HandlerError::permanent(format!("no account {account}")));
            };
            let balance = row.get::<_, i64>(0) + amount;
            tx.execute(&write, &[&account, &balance]).await?;
        }
    }
    log(tx, transfers, false).await
});
