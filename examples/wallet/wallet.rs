//! The wallet's handler: a transfer moves money between two accounts, once
//! however often it arrives, says so (`transfer.completed`), and, when it
//! can never apply (an unknown account, too little money), says that
//! instead (`transfer.rejected`), once per time it is given up.

use idem::handler::{
    GivenUp, Handler, HandlerError, Invalid, Migration, Outbox, OutboxMessage, Transaction,
};

/// Where the wallet's messages go; the service declares it.
pub(crate) const EVENTS: &str = "wallet.events";

/// `{"eventId": "t-1", "from": "alice", "to": "bob", "amount": 10}`
#[derive(Debug, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Transfer {
    pub(crate) event_id: String,
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) amount: i64,
}

/// Moves money, and says what became of each transfer.
pub(crate) struct Wallet;

/// The batch's accounts, locked in one order: batches in flight at once
/// never wait on each other in a circle. `$1` accounts.
const LOCK: &str = "SELECT id FROM account WHERE id = ANY($1) ORDER BY id FOR UPDATE";

/// One leg of a transfer; no row when the account is missing or would go
/// below zero. `$1` account, `$2` amount (negative for a debit).
const MOVE: &str = "UPDATE account SET balance = balance + $2 \
    WHERE id = $1 AND balance + $2 >= 0 RETURNING id";

const RECORD: &str = "INSERT INTO transfer VALUES ($1, $2, $3, $4)";

impl Handler for Wallet {
    type Event = Transfer;
    const NAME: &'static str = "wallet";
    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_wallet.sql",
        sql: include_str!("0001_wallet.sql"),
    }];
    const SENDS_MESSAGES: bool = true;

    fn decode(&self, body: &[u8]) -> Result<Transfer, Invalid> {
        let transfer: Transfer = serde_json::from_slice(body)?;
        if transfer.amount <= 0 || transfer.from == transfer.to {
            return Err(Invalid::new(
                "a transfer moves a positive amount between two accounts",
            ));
        }
        Ok(transfer)
    }

    fn event_id<'e>(&self, transfer: &'e Transfer) -> &'e str {
        &transfer.event_id
    }

    /// Each transfer in turn, in the order given: the batch's effect is
    /// its transfers' one at a time (netting a batch per account would let
    /// `a → b` and `b → a` pass together on empty accounts).
    async fn apply(
        &self,
        tx: &Transaction<'_>,
        transfers: &[&Transfer],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        let accounts: Vec<&str> = transfers
            .iter()
            .flat_map(|t| [t.from.as_str(), t.to.as_str()])
            .collect();
        tx.query(&tx.prepare_cached(LOCK).await?, &[&accounts])
            .await?;
        let (step, record) = (
            tx.prepare_cached(MOVE).await?,
            tx.prepare_cached(RECORD).await?,
        );
        for t in transfers {
            if tx.query(&step, &[&t.from, &-t.amount]).await?.is_empty() {
                return Err(HandlerError::permanent_for(
                    "no such account, or too little in it",
                    &t.from,
                ));
            }
            if tx.query(&step, &[&t.to, &t.amount]).await?.is_empty() {
                return Err(HandlerError::permanent_for("no such account", &t.to));
            }
            tx.execute(&record, &[&t.event_id, &t.from, &t.to, &t.amount])
                .await?;
        }
        Ok(())
    }

    fn outgoing(&self, transfer: &Transfer) -> Vec<OutboxMessage> {
        let body = serde_json::to_vec(transfer).unwrap_or_default();
        vec![OutboxMessage::json(EVENTS, "transfer.completed", body)]
    }

    /// The payer is told, once per time the transfer is given up.
    fn given_up(&self, given_up: &GivenUp<'_, Transfer>) -> Vec<OutboxMessage> {
        let GivenUp::Event { event, error } = given_up else {
            return Vec::new();
        };
        let body =
            serde_json::json!({"eventId": event.event_id, "from": event.from, "reason": error});
        vec![OutboxMessage::json(
            EVENTS,
            "transfer.rejected",
            body.to_string().into_bytes(),
        )]
    }
}
