//! Spans exported over OTLP (HTTP, protobuf), configured by the
//! OpenTelemetry SDK's own variables: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns it on; `…_HEADERS`,
//! `…_TIMEOUT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_TRACES_SAMPLER` and `OTEL_BSP_*` work as everywhere else;
//! `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off.

use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// A setting the exporter cannot use, said without a secret.
#[derive(Debug, thiserror::Error)]
#[error("cannot export traces: {0}")]
pub struct ExportError(String);

/// The variables that may hold a credential, whose values an error must
/// not repeat.
const SECRET_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
];

fn variable(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

/// The provider that exports spans as the service `name`, or `None` when
/// no endpoint is set or the SDK's variables turn traces off.
pub(super) fn provider(name: &str) -> Result<Option<SdkTracerProvider>, ExportError> {
    let endpoint = variable("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| variable("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let disabled = variable("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || variable("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
    if endpoint.is_none() || disabled {
        return Ok(None);
    }
    for protocol in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        match variable(protocol) {
            Some(value) if value != "http/protobuf" => {
                return Err(ExportError(format!(
                    "{protocol} is {value:?}, but idem exports over \"http/protobuf\" only \
                     (a collector's port 4318)"
                )));
            }
            Some(_) => break,
            None => {}
        }
    }
    // The exporter's HTTPS client takes the process's TLS provider.
    let _ = crate::tls::provider().install_default();
    let exporter = SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|error| ExportError(without_secrets(&error.to_string())))?;
    let mut resource = Resource::builder();
    let named = variable("OTEL_SERVICE_NAME").is_some()
        || variable("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
    if !named {
        resource = resource.with_service_name(name.to_owned());
    }
    Ok(Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build(),
    ))
}

/// `message` with any password of a URL masked and the values of the
/// header variables left out.
fn without_secrets(message: &str) -> String {
    SECRET_VARIABLES
        .iter()
        .filter_map(|name| variable(name))
        .fold(crate::secret::redact(message), |message, value| {
            message.replace(&value, "***")
        })
}
