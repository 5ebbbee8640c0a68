//! The points service on idem: the reference handler, a "payment
//! succeeded" event credits its order's points once ([`points`]), and what
//! only the `idem` binary has beside every command [`idem::cli`] gives any
//! handler's binary: `publish`, `demo`, `bench` and `lab`
//! ([`commands`]), with reproducible loads of payment events
//! ([`generate`]).
//!
//! Not published: a service depends on the library `idem`, and reads this
//! crate as an example of one.

pub mod commands;
pub mod generate;
pub mod points;
