//! Who may do what: reading is open on a loopback address, acting needs
//! the token (a bearer header, or the session cookie the login page sets)
//! or a user named by a trusted proxy; a POST must come from the console's
//! own pages (same origin, the process's form token).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, Mac};
use maud::html;
use sha2::Sha256;
use tokio::time::Instant;
use tracing::warn;

use super::Console;
use super::view::{self, Fields};
use crate::handler::Handler;

/// The cookie of a session opened with the token.
const SESSION_COOKIE: &str = "idem_console";

/// The console's token: never shown, logged or printed.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// A token; `None` when `text` is empty (after trimming a file's
    /// newline).
    pub fn new(text: &str) -> Option<Self> {
        let text = text.trim();
        (!text.is_empty()).then(|| Self(text.to_owned()))
    }

    /// Whether `offered` is the token, in time that does not say how much
    /// of it matched.
    fn admits(&self, offered: &str) -> bool {
        same(offered, &self.0)
    }

    /// The session cookie's value for this token.
    fn session(&self) -> String {
        hex(&tag(self.0.as_bytes(), b"idem console session"))
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(…)")
    }
}

fn mac(key: &[u8], message: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(message);
    mac
}

fn tag(key: &[u8], message: &[u8]) -> Vec<u8> {
    mac(key, message).finalize().into_bytes().to_vec()
}

/// Whether `offered` is `expected`, compared in time that does not say
/// how much of it matched (their HMACs, compared in constant time).
fn same(offered: &str, expected: &str) -> bool {
    const KEY: &[u8] = b"idem console comparison";
    mac(KEY, offered.as_bytes())
        .verify_slice(&tag(KEY, expected.as_bytes()))
        .is_ok()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The process's key for its form tokens: a form rendered by another
/// process (or a page of another site) does not carry its token.
pub(super) struct FormKey([u8; 32]);

impl FormKey {
    pub(super) fn random() -> Result<Self, String> {
        let mut key = [0; 32];
        getrandom::fill(&mut key).map_err(|e| e.to_string())?;
        Ok(Self(key))
    }

    /// The token every form of this process carries.
    pub(super) fn token(&self) -> String {
        hex(&tag(&self.0, b"idem console form"))
    }

    fn admits(&self, offered: &str) -> bool {
        same(offered, &self.token())
    }
}

/// Who asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Who {
    /// Nobody known.
    Anyone,
    /// The token's holder, by a bearer header (a program, not a browser:
    /// no form token needed) or by the session cookie.
    Token { bearer: bool },
    /// A user the trusted proxy named.
    User(String),
}

impl Who {
    pub(super) fn may_act(&self) -> bool {
        !matches!(self, Who::Anyone)
    }

    /// Who may act, as the pages name them; `None` for nobody.
    pub(super) fn acting(&self) -> Option<String> {
        self.may_act().then(|| self.audited())
    }

    /// As the audit records it.
    pub(super) fn audited(&self) -> String {
        match self {
            Who::Anyone => "anyone".to_owned(),
            Who::Token { bearer: true } => "the token's holder (bearer)".to_owned(),
            Who::Token { bearer: false } => "the token's holder (session)".to_owned(),
            Who::User(user) => format!("user {user}"),
        }
    }
}

/// Someone the console lets read its pages.
pub(super) struct Reader(pub(super) Who);

impl<H: Handler> FromRequestParts<Console<H>> for Reader {
    type Rejection = Refusal;

    async fn from_request_parts(parts: &mut Parts, console: &Console<H>) -> Result<Self, Refusal> {
        console.may_read(&parts.headers).map(Reader)
    }
}

/// A form of this console's pages, sent by someone who may act (or a
/// program's request with the bearer token).
pub(super) struct Acting {
    pub(super) who: Who,
    pub(super) fields: Fields,
}

impl<H: Handler> FromRequest<Console<H>> for Acting {
    type Rejection = Response;

    async fn from_request(request: Request, console: &Console<H>) -> Result<Self, Response> {
        let (headers, fields) = form(request, console).await?;
        let who = console
            .may_act(&headers, &fields)
            .map_err(IntoResponse::into_response)?;
        Ok(Self { who, fields })
    }
}

/// A request's headers and its form's fields.
async fn form<H: Handler>(
    request: Request,
    console: &Console<H>,
) -> Result<(HeaderMap, Fields), Response> {
    let headers = request.headers().clone();
    let body = Bytes::from_request(request, console)
        .await
        .map_err(IntoResponse::into_response)?;
    Ok((headers, Fields::parse(&body)))
}

/// A form of this console's own pages (same origin, the process's form
/// token), whoever sends it: logging in and out.
pub(super) struct OwnForm(Fields);

impl<H: Handler> FromRequest<Console<H>> for OwnForm {
    type Rejection = Response;

    async fn from_request(request: Request, console: &Console<H>) -> Result<Self, Response> {
        let (headers, fields) = form(request, console).await?;
        same_origin(&headers)
            .and_then(|()| console.form_token_checked(&fields))
            .map_err(IntoResponse::into_response)?;
        Ok(Self(fields))
    }
}

impl<H: Handler> Console<H> {
    /// Who the request comes from.
    pub(super) fn who(&self, headers: &HeaderMap) -> Who {
        let config = &self.inner.config;
        if let Some(name) = &config.trusted_user_header
            && let Some(user) = headers.get(name.as_str()).and_then(|v| v.to_str().ok())
            && !user.trim().is_empty()
        {
            return Who::User(user.trim().to_owned());
        }
        let Some(token) = &config.token else {
            return Who::Anyone;
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if let Some(offered) = bearer {
            return if token.admits(offered.trim()) {
                Who::Token { bearer: true }
            } else {
                Who::Anyone
            };
        }
        let session = token.session();
        let cookie =
            cookies(headers).any(|(name, value)| name == SESSION_COOKIE && same(value, &session));
        if cookie {
            Who::Token { bearer: false }
        } else {
            Who::Anyone
        }
    }

    /// Reading: open, unless the console listens beyond loopback.
    fn may_read(&self, headers: &HeaderMap) -> Result<Who, Refusal> {
        let who = self.who(headers);
        if self.inner.config.reading_needs_token && !who.may_act() {
            return Err(Refusal::new(
                StatusCode::UNAUTHORIZED,
                "this console listens beyond loopback: log in with the token to read it",
            ));
        }
        Ok(who)
    }

    /// Acting: from this console's own page (same origin, its form token)
    /// or a program with the bearer token; by someone the token or the
    /// proxy admits.
    fn may_act(&self, headers: &HeaderMap, fields: &Fields) -> Result<Who, Refusal> {
        same_origin(headers)?;
        let who = self.who(headers);
        if !who.may_act() {
            let why = if self.inner.config.token.is_none()
                && self.inner.config.trusted_user_header.is_none()
            {
                "actions need a token, and this console has none: start it with \
                 IDEM_CONSOLE_TOKEN set (or --console-token-file)"
            } else {
                "actions need the token: log in first"
            };
            return Err(Refusal::new(StatusCode::FORBIDDEN, why));
        }
        if who != (Who::Token { bearer: true }) {
            self.form_token_checked(fields)?;
        }
        Ok(who)
    }

    fn form_token_checked(&self, fields: &Fields) -> Result<(), Refusal> {
        let offered = fields.one("form_token").unwrap_or_default();
        if self.inner.forms.admits(offered) {
            Ok(())
        } else {
            Err(Refusal::new(
                StatusCode::FORBIDDEN,
                "this form is not one of this console's pages (or the console restarted since it \
                 was shown): open the page again",
            ))
        }
    }

    /// The token a form of this process carries.
    pub(super) fn form_token(&self) -> String {
        self.inner.forms.token()
    }
}

/// The cookies of a request, name and value.
fn cookies(headers: &HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
}

/// A POST from another site's page is refused: the browser says where it
/// comes from (`Origin`, `Sec-Fetch-Site`), and it must be this host.
fn same_origin(headers: &HeaderMap) -> Result<(), Refusal> {
    let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if let Some(site) = site
        && site != "same-origin"
        && site != "none"
    {
        return Err(Refusal::new(
            StatusCode::FORBIDDEN,
            "a request from another site's page is refused",
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        let own = host.is_some_and(|host| {
            origin.to_str().is_ok_and(|origin| {
                origin == format!("http://{host}") || origin == format!("https://{host}")
            })
        });
        if !own {
            return Err(Refusal::new(
                StatusCode::FORBIDDEN,
                "a request from another origin is refused",
            ));
        }
    }
    Ok(())
}

/// A request refused, and why; answered as a page.
#[derive(Debug)]
pub(super) struct Refusal {
    status: StatusCode,
    why: &'static str,
}

impl Refusal {
    const fn new(status: StatusCode, why: &'static str) -> Self {
        Self { status, why }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        refused(self.status, self.why)
    }
}

/// A refusal, as a page.
pub(super) fn refused(status: StatusCode, why: &str) -> Response {
    let page = view::layout(
        "Refused",
        None,
        html! {
            h1 { "Refused" }
            p.refused { (why) }
            p { a href="/login" { "Log in" } " · " a href="/" { "Overview" } }
        },
    );
    (status, page).into_response()
}

/// `GET /login`: the token, entered once.
pub(super) async fn login_page<H: Handler>(
    State(console): State<Console<H>>,
    headers: HeaderMap,
) -> Response {
    let who = console.who(&headers);
    let token_set = console.inner.config.token.is_some();
    view::layout(
        "Log in",
        who.acting().as_deref(),
        html! {
            h1 { "Log in" }
            @if !token_set {
                p.refused { "This console has no token: actions are refused until it is started with IDEM_CONSOLE_TOKEN set (or --console-token-file)." }
            } @else if who.may_act() {
                p { "You may act: " (who.audited()) "." }
                @if who == (Who::Token { bearer: false }) {
                    form method="post" action="/logout" {
                        input type="hidden" name="form_token" value=(console.form_token());
                        button.plain type="submit" { "Log out" }
                    }
                }
            }
            form method="post" action="/login" {
                input type="hidden" name="form_token" value=(console.form_token());
                label for="token" { "Token" }
                input #token type="password" name="token" autocomplete="off" required;
                button type="submit" { "Log in" }
            }
        },
    )
    .into_response()
}

/// Wrong tokens a client address may try at the login before it must wait.
const FREE_TRIES: u32 = 5;

/// The longest a client address waits between two tries.
const LONGEST_WAIT: Duration = Duration::from_secs(60);

/// How long an address's wrong tries are remembered after its last.
const FORGOTTEN_AFTER: Duration = Duration::from_secs(15 * 60);

/// Wrong tokens at the login, per client address: past [`FREE_TRIES`],
/// each try waits twice as long as the last (at most [`LONGEST_WAIT`]),
/// answered 429 before then, so that guessing the token goes nowhere.
#[derive(Debug, Default)]
pub(super) struct LoginTries(std::sync::Mutex<HashMap<Option<IpAddr>, Tries>>);

#[derive(Debug, Clone, Copy)]
struct Tries {
    wrong: u32,
    last: Instant,
    next: Instant,
}

impl LoginTries {
    /// How long `from` must still wait before it may try, if it must.
    fn wait(&self, from: Option<IpAddr>, now: Instant) -> Option<Duration> {
        let mut tries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        tries.retain(|_, tries| now.duration_since(tries.last) < FORGOTTEN_AFTER);
        let next = tries.get(&from)?.next;
        (next > now).then(|| next - now)
    }

    /// One more wrong token from `from`; how many in a row.
    fn wrong(&self, from: Option<IpAddr>, now: Instant) -> u32 {
        let mut tries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let entry = tries.entry(from).or_insert(Tries {
            wrong: 0,
            last: now,
            next: now,
        });
        entry.wrong += 1;
        entry.last = now;
        let past = entry.wrong.saturating_sub(FREE_TRIES);
        entry.next = match past {
            0 => now,
            n => now + (Duration::from_secs(1) * 2u32.pow((n - 1).min(6))).min(LONGEST_WAIT),
        };
        entry.wrong
    }

    /// The right token from `from`: its wrong tries are forgotten.
    fn right(&self, from: Option<IpAddr>) {
        let mut tries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        tries.remove(&from);
    }
}

/// The client's address, when the server was told it (the console's own
/// and the worker's are).
pub(super) struct ClientAddr(Option<IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for ClientAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let extensions = &parts.extensions;
        let plain = extensions.get::<axum::extract::ConnectInfo<SocketAddr>>();
        let tls = extensions.get::<axum::extract::ConnectInfo<super::tls::TlsPeer>>();
        Ok(Self(
            plain
                .map(|info| info.0.ip())
                .or_else(|| tls.map(|info| info.0.0.ip())),
        ))
    }
}

/// `POST /login`: sets the session cookie when the token is right. Past a
/// few wrong tokens from one address, its tries wait longer and longer;
/// each wrong one is audited.
pub(super) async fn login<H: Handler>(
    State(console): State<Console<H>>,
    ClientAddr(from): ClientAddr,
    OwnForm(fields): OwnForm,
) -> Response {
    let Some(token) = &console.inner.config.token else {
        return refused(StatusCode::FORBIDDEN, "this console has no token");
    };
    let tries = &console.inner.tries;
    if let Some(wait) = tries.wait(from, Instant::now()) {
        let seconds = wait.as_secs().max(1);
        let mut response = refused(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("too many wrong tokens from your address: try again in {seconds} s"),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(seconds));
        return response;
    }
    if !token.admits(fields.one("token").unwrap_or_default().trim()) {
        let wrong = tries.wrong(from, Instant::now());
        let address = from.map_or_else(|| "an unknown address".to_owned(), |ip| ip.to_string());
        warn!(from = %address, wrong, "a wrong token at the console's login");
        audit_refusal(&console, &address, wrong).await;
        return refused(StatusCode::FORBIDDEN, "that is not the token");
    }
    tries.right(from);
    // Over TLS, the browser never sends it in plain text.
    let secure = if console.inner.config.tls.is_some() {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{SESSION_COOKIE}={}; Path=/; HttpOnly; SameSite=Strict{secure}",
        token.session()
    );
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

/// `POST /logout`: forgets the session.
pub(super) async fn logout(_: OwnForm) -> Response {
    let cookie = format!("{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

/// Records a wrong token at the login in the audit, as an action refused.
async fn audit_refusal<H: Handler>(console: &Console<H>, address: &str, wrong: u32) {
    let audited = crate::store::console::Audited {
        id: 0,
        consumer_group: console.inner.config.target.consumer_group.clone(),
        action: "login".to_owned(),
        who: format!("anyone at {address}"),
        filter: String::new(),
        expected: 0,
        started_at: std::time::SystemTime::now(),
        finished_at: None,
        letters: None,
        outcome: None,
        file: None,
        edit: None,
    };
    let recorded = async {
        let client = console.inner.store.pool().get().await?;
        let id = crate::store::console::audit_start(&client, &audited).await?;
        let outcome = format!("refused: a wrong token ({wrong} in a row from this address)");
        crate::store::console::audit_end(&client, id, 0, &outcome).await?;
        Ok::<_, crate::store::StoreError>(())
    };
    if let Err(error) = recorded.await {
        warn!(%error, "the audit could not record a wrong token at the login");
    }
}
