//! The worker's HTTP endpoints: `/metrics` for Prometheus, `/healthz` (the
//! process and its loop answer) and `/readyz` (consuming, and the database
//! answers: not ready while deliveries are held for it).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::health::DatabaseHealth;
use super::stats::Stats;

/// What the endpoints look at.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    pub(crate) stats: Arc<Stats>,
    pub(crate) health: DatabaseHealth,
    pub(crate) pool: Pool,
}

/// Serves the endpoints on `listener` until `shutdown`.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    probe: Probe,
    routes: Option<Router>,
    shutdown: CancellationToken,
) {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    let routes = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(probe)
        .merge(routes.unwrap_or_default());
    // The client's address, which the console's login counts tries by.
    let routes = routes.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let served = axum::serve(listener, routes)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await;
    if let Err(error) = served {
        warn!(%error, "the HTTP endpoints stopped");
    }
}

async fn metrics(State(probe): State<Probe>) -> impl IntoResponse {
    // Gauges read at the moment of the scrape.
    probe.stats.database_up(probe.health.is_up());
    probe.stats.pool(probe.pool.status());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        probe.stats.encode(),
    )
}

/// The process answers from the runtime the worker's loop runs on, which a
/// stuck loop would not leave free to answer.
async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(probe): State<Probe>) -> (StatusCode, &'static str) {
    if !probe.stats.is_consuming() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not consuming: connecting to RabbitMQ\n",
        );
    }
    if !probe.health.is_up() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the database is unavailable: deliveries are held\n",
        );
    }
    (StatusCode::OK, "ready\n")
}
