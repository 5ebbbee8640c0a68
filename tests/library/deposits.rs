//! A team's handler, written against the library's API alone: deposits
//! credit an account's balance, which a constraint keeps below a million;
//! a closed account can never take one.

use idem::{
    Handler, HandlerError, Invalid, Migration, Outbox, OutboxMessage, Topology, Transaction,
};

/// `{"eventId": "deposit-1", "account": "ada", "amount": 100}`
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Deposit {
    pub event_id: String,
    pub account: String,
    pub amount: i64,
}

/// The body of a deposit.
pub fn body(event_id: &str, account: &str, amount: i64) -> Vec<u8> {
    serde_json::json!({"eventId": event_id, "account": account, "amount": amount})
        .to_string()
        .into_bytes()
}

/// The account a deposit can never be made to.
pub const CLOSED: &str = "closed";

/// Where the deposits' work queue takes them from.
pub fn topology() -> Topology {
    Topology::for_queue("deposits.made").bound_to("bank", "deposit.made")
}

/// Credits balances; announces each credit on `announce_to`, when set,
/// through idem's outbox.
#[derive(Debug, Clone, Default)]
pub struct Deposits {
    pub announce_to: Option<String>,
}

impl Handler for Deposits {
    type Event = Deposit;

    const NAME: &'static str = "deposits";

    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_balances.sql",
        sql: "CREATE TABLE balances (
                  account TEXT PRIMARY KEY,
                  amount BIGINT NOT NULL CHECK (amount < 1000000)
              )",
    }];

    const SENDS_MESSAGES: bool = true;

    fn decode(&self, body: &[u8]) -> Result<Deposit, Invalid> {
        let deposit: Deposit = serde_json::from_slice(body)?;
        if deposit.amount <= 0 {
            return Err(Invalid::new("amount must be positive"));
        }
        Ok(deposit)
    }

    fn event_id<'e>(&self, event: &'e Deposit) -> &'e str {
        &event.event_id
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&Deposit],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        if let Some(closed) = events.iter().find(|event| event.account == CLOSED) {
            return Err(HandlerError::permanent(format!(
                "account {} is closed ({})",
                closed.account, closed.event_id
            )));
        }
        let accounts: Vec<&str> = events.iter().map(|event| event.account.as_str()).collect();
        let amounts: Vec<i64> = events.iter().map(|event| event.amount).collect();
        let credit = tx
            .prepare_cached(
                "INSERT INTO balances (account, amount)
                 SELECT account, sum(amount) FROM unnest($1::text[], $2::bigint[]) AS d(account, amount)
                 GROUP BY account
                 ON CONFLICT (account) DO UPDATE SET amount = balances.amount + EXCLUDED.amount",
            )
            .await?;
        tx.execute(&credit, &[&accounts, &amounts]).await?;
        Ok(())
    }

    fn outgoing(&self, event: &Deposit) -> Vec<OutboxMessage> {
        let Some(exchange) = &self.announce_to else {
            return Vec::new();
        };
        vec![OutboxMessage::json(
            exchange,
            "deposit.credited",
            body(&event.event_id, &event.account, event.amount),
        )]
    }
}
