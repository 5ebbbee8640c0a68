//! What a run did to its events' effect: how many it applied more than
//! once, how many never.

/// Events applied twice or more, and never, out of how many.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Exactness {
    /// Distinct events sent.
    pub events: usize,
    /// Events whose effect is there more than once.
    pub twice: usize,
    /// Events whose effect is not there, though it should be.
    pub lost: usize,
}

impl Exactness {
    /// Neither doubled nor lost anything.
    pub fn clean(&self) -> bool {
        self.twice == 0 && self.lost == 0
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: Exactness) {
        self.events += other.events;
        self.twice += other.twice;
        self.lost += other.lost;
    }
}
