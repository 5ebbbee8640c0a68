//! The TCP proxy the fault tests put between idem and the servers: the
//! library's, which `check` cuts its workers' connections with.

pub use idem::trial::proxy::Proxy;
