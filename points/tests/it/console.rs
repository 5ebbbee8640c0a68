//! The console in a real browser (Chromium, driven through chromedriver),
//! against a worker, RabbitMQ and PostgreSQL: an operator finds a failing
//! group, opens a letter, is refused an action without the token, logs in,
//! replays the group once the cause is fixed, and finds the action in the
//! audit; a body and an error holding HTML are shown as text and run
//! nothing. And, without a browser, what a stranger would try: a POST from
//! another origin, a forged form, reading a console that listens beyond
//! loopback.
//!
//! The browser tests need `chromedriver` and Chromium (`apt-get install
//! chromium chromium-driver`; `.ci/run` installs them): without them they
//! say they were skipped, and why. `IDEM_SCREENSHOTS=DIR` keeps the pages
//! they see as PNG files (the guide's pictures come from there).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use tokio_util::sync::CancellationToken;

use idem::console::{Console, ConsoleConfig, Token};
use idem::worker::Mode;
use idem_points::points::{PaymentSucceeded, Points};

use crate::support::{
    GROUP, RunningWorker, TestEnv, WorkerProcess, amqp_url, database_url, free_port, http_get,
    idem_command, patient, wait_for,
};

const TOKEN: &str = "a-console-token-for-the-tests";

/// A console of `env`'s group, in this process, on a port of its own.
struct RunningConsole {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RunningConsole {
    async fn start(
        env: &TestEnv,
        configure: impl FnOnce(&mut ConsoleConfig),
    ) -> anyhow::Result<Self> {
        let mut config = ConsoleConfig::new(idem::Target::new(
            env.amqp.clone(),
            env.database.clone(),
            env.topology.clone(),
            GROUP,
            patient(Duration::from_secs(10)),
        ));
        config.token = Token::new(TOKEN);
        config.discard_dir = std::env::temp_dir().join(format!("{}-discarded", env.name));
        configure(&mut config);
        let shutdown = CancellationToken::new();
        let console = Console::new(config, Arc::new(Points), shutdown.clone()).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(console.serve_on(listener));
        Ok(Self {
            addr,
            shutdown,
            task,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.task.await?;
        Ok(())
    }
}

/// Chromium, headless, through a chromedriver of this test's own.
struct Browser {
    client: Client,
    _driver: tokio::process::Child,
}

impl Browser {
    /// `None`, having said why, where there is no chromedriver.
    async fn start() -> anyhow::Result<Option<Self>> {
        let driver =
            std::env::var("IDEM_TEST_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let port = free_port()?;
        let child = tokio::process::Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                // Past the test harness's capture, which would keep it
                // from a passing test's output.
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "skipped: no {driver} on this machine (apt-get install chromium chromium-driver, \
                     or set IDEM_TEST_CHROMEDRIVER): the console's browser tests did not run"
                );
                return Ok(None);
            }
            Err(error) => return Err(error).context(format!("starting {driver}")),
        };
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,900"]
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        wait_for(
            "chromedriver to answer",
            Duration::from_secs(20),
            || async {
                Ok(tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok())
            },
        )
        .await?;
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(capabilities)
            .connect(&url)
            .await
            .context("opening a Chromium session")?;
        Ok(Some(Self {
            client,
            _driver: child,
        }))
    }

    async fn text(&self, css: &str) -> anyhow::Result<String> {
        Ok(self.client.find(Locator::Css(css)).await?.text().await?)
    }

    /// The text of `css` once it holds `expected`: a click that submits a
    /// form returns before the next page is there, and an element read as
    /// a page goes is gone (and read again).
    async fn text_holding(&self, css: &str, expected: &str) -> anyhow::Result<String> {
        let last = std::sync::Mutex::new(String::new());
        let found = wait_for(
            &format!("{expected:?} on the page"),
            Duration::from_secs(10),
            || async {
                let Ok(text) = self.text(css).await else {
                    return Ok(false);
                };
                let holds = text.contains(expected);
                if let Ok(mut last) = last.lock() {
                    *last = text;
                }
                Ok(holds)
            },
        )
        .await;
        let last = last.into_inner().unwrap_or_default();
        found.with_context(|| format!("the page says: {last}"))?;
        Ok(last)
    }

    /// Keeps the page as `name.png` under `IDEM_SCREENSHOTS`, when set.
    async fn keep(&self, name: &str) -> anyhow::Result<()> {
        if let Ok(dir) = std::env::var("IDEM_SCREENSHOTS") {
            std::fs::create_dir_all(&dir)?;
            let png = self.client.screenshot().await?;
            std::fs::write(std::path::Path::new(&dir).join(format!("{name}.png")), png)?;
        }
        Ok(())
    }

    /// Logs in to `console` with the token, as an operator would.
    async fn log_in(&self, console: &RunningConsole) -> anyhow::Result<()> {
        let page = &self.client;
        page.goto(&console.url("/login")).await?;
        page.find(Locator::Css("#token"))
            .await?
            .send_keys(TOKEN)
            .await?;
        page.find(Locator::Css("form[action='/login'] button"))
            .await?
            .click()
            .await?;
        self.text_holding("nav", "the token's holder (session)")
            .await?;
        Ok(())
    }

    async fn close(self) -> anyhow::Result<()> {
        self.client.close().await?;
        Ok(())
    }
}

/// Opens the poisoned order's failure group from the groups page.
async fn open_poisoned_group(browser: &Browser, console: &RunningConsole) -> anyhow::Result<()> {
    let page = &browser.client;
    page.goto(&console.url("/groups")).await?;
    page.find(Locator::XPath(
        "//a[contains(., 'order poison-order is poisoned')]",
    ))
    .await?
    .click()
    .await?;
    Ok(())
}

/// The page in `browser` offers no button of the action `value`, nor any
/// form that posts, but a link to log in.
async fn no_action_offered(browser: &Browser, value: &str) -> anyhow::Result<()> {
    let page = &browser.client;
    let buttons = page
        .find_all(Locator::Css(&format!("button[value={value}]")))
        .await?;
    ensure!(buttons.is_empty(), "a {value} button shown to a reader");
    let forms = page.find_all(Locator::Css("form[method=post]")).await?;
    ensure!(forms.is_empty(), "a form that posts shown to a reader");
    let log_in = page.find_all(Locator::Css("main a[href='/login']")).await?;
    ensure!(
        !log_in.is_empty(),
        "no way to log in where the actions were"
    );
    Ok(())
}

fn poisoned(env: &TestEnv, i: usize) -> PaymentSucceeded {
    PaymentSucceeded {
        event_id: format!("{}-poisoned-{i}", env.name),
        order_id: "poison-order".into(),
        points: 1,
    }
}

/// Dead-letters `bodies` through a worker that gives up on the first
/// failure; returns it still running.
async fn dead_lettered(
    env: &TestEnv,
    bodies: &[Vec<u8>],
    letters: u32,
) -> anyhow::Result<RunningWorker> {
    env.publish_bodies(bodies).await?;
    let mut config = env.worker_config(Mode::Batch);
    config.topology.retry = config.topology.retry.clone().with_attempts(1);
    let worker = RunningWorker::start(config);
    wait_for("the dead letters", Duration::from_secs(30), || async {
        Ok(env.ready(&env.topology.dead_letter_queue).await? == letters)
    })
    .await?;
    Ok(worker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_finds_the_failing_group_and_replays_it_once_with_the_token()
-> anyhow::Result<()> {
    let Some(browser) = Browser::start().await? else {
        return Ok(());
    };
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    let events: Vec<PaymentSucceeded> = (0..3).map(|i| poisoned(&env, i)).collect();
    // The first one's keys as a producer may write them: not in order.
    let mut bodies: Vec<Vec<u8>> = events.iter().map(PaymentSucceeded::to_body).collect();
    bodies[0] = format!(
        r#"{{"points": {}, "orderId": "{}", "eventId": "{}"}}"#,
        events[0].points, events[0].order_id, events[0].event_id
    )
    .into_bytes();
    bodies.push(br#"{"eventId": "e", "orderId": "o", "points": -1}"#.to_vec());
    let worker = dead_lettered(&env, &bodies, 4).await?;
    let console = RunningConsole::start(&env, |_| {}).await?;
    let page = &browser.client;

    // The overview counts them; the groups page shows the failing group.
    page.goto(&console.url("/")).await?;
    let overview = browser.text("main").await?;
    ensure!(overview.contains("4\ndead letters"), "{overview}");
    ensure!(
        overview.contains(&env.topology.dead_letter_queue),
        "{overview}"
    );
    browser.keep("console-overview").await?;
    page.goto(&console.url("/groups")).await?;
    browser.keep("console-groups").await?;
    let group_link = page
        .find(Locator::XPath(
            "//a[contains(., 'order poison-order is poisoned')]",
        ))
        .await
        .context("the poisoned order's group is listed")?;
    group_link.click().await?;
    let group = browser
        .text_holding("main", "Log in to replay or discard these letters")
        .await?;
    for event in &events {
        ensure!(group.contains(&event.event_id), "{group}");
    }
    browser.keep("console-group").await?;

    // A letter: its body, its failure, what a replay would do.
    page.find(Locator::LinkText(&events[0].event_id))
        .await?
        .click()
        .await?;
    let letter = browser.text_holding("main", "a replay now").await?;
    let shown = browser.text("pre.body").await?;
    ensure!(shown.contains("\"orderId\": \"poison-order\""), "{letter}");
    // As it was sent, its keys in their order.
    let place = |key: &str| shown.find(&format!("\"{key}\""));
    ensure!(
        place("points") < place("orderId") && place("orderId") < place("eventId"),
        "the body's keys re-ordered: {shown}"
    );
    ensure!(
        letter.contains("order poison-order is poisoned"),
        "{letter}"
    );
    ensure!(letter.contains("applies it"), "{letter}");
    browser.keep("console-letter").await?;

    // Without the token, no action is offered: a way to log in is.
    no_action_offered(&browser, "replay-selected").await?;
    open_poisoned_group(&browser, &console).await?;
    no_action_offered(&browser, "replay").await?;
    ensure!(env.count_rows("idem_console_audit").await? == 0);

    // Logged in, and the cause fixed: the group is replayed, once.
    browser.log_in(&console).await?;
    env.sql("DROP TRIGGER poison ON user_points").await?;
    open_poisoned_group(&browser, &console).await?;
    page.find(Locator::Css("button[value=replay]"))
        .await?
        .click()
        .await?;
    browser
        .text_holding("main", "events a replay would apply 3")
        .await?;
    browser.keep("console-dry-run").await?;
    page.find(Locator::Css("form[action='/actions'] button"))
        .await?
        .click()
        .await?;
    // The page reloads itself while the action runs.
    browser.text_holding("main", "replayed 3").await?;
    browser.keep("console-action").await?;
    wait_for(
        "the replayed events' points",
        Duration::from_secs(30),
        || async { Ok(env.points("poison-order").await? == 3) },
    )
    .await?;
    for event in &events {
        ensure!(env.records_of(&event.event_id, GROUP).await? == 1);
    }
    ensure!(
        env.ready(&env.topology.dead_letter_queue).await? == 1,
        "the invalid body stays"
    );

    // The audit says who did what, to how many, and how it ended.
    page.goto(&console.url("/audit")).await?;
    let audit = browser.text("main table").await?;
    ensure!(audit.contains("the token's holder (session)"), "{audit}");
    ensure!(audit.contains("replay"), "{audit}");
    ensure!(audit.contains("replayed 3"), "{audit}");
    browser.keep("console-audit").await?;

    browser.close().await?;
    console.stop().await?;
    worker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_releases_a_parked_key_after_a_dry_run_and_the_audit_says_so()
-> anyhow::Result<()> {
    let Some(browser) = Browser::start().await? else {
        return Ok(());
    };
    // A key holding HTML, as a stranger's producer might send it: shown as
    // text, run never.
    const HELD: &str = r#"held<script>document.title="pwned"</script>"#;
    // An ordered queue: the held order's first event dies at once, and its
    // key is parked behind it with its two later events.
    let env = TestEnv::ordered_on_broker(amqp_url(), 2).await?;
    env.poison_order(HELD).await?;
    let event = |order: &str, n: usize| PaymentSucceeded {
        event_id: format!("{}-{order}-{n}", env.name),
        order_id: order.to_owned(),
        points: 1,
    };
    let messages: Vec<idem::broker::Outgoing> = [event(HELD, 1), event(HELD, 2)]
        .into_iter()
        .chain([event(HELD, 3), event("free", 1)])
        .map(|e| {
            env.topology
                .event(e.to_body())
                .with_ordering_key(&e.order_id)
        })
        .collect();
    crate::support::publish_messages(&env.amqp, &messages).await?;
    let mut config = env.worker_config(Mode::Batch);
    config.topology.retry = config.topology.retry.clone().with_attempts(1);
    let worker = RunningWorker::start(config);
    wait_for("the held order parked", Duration::from_secs(30), || async {
        Ok(env.count_rows("mq_parked_event").await? == 2
            && env.points("free").await? == 1
            && env.ready(&env.topology.dead_letter_queue).await? == 1)
    })
    .await?;
    let console = RunningConsole::start(&env, |_| {}).await?;
    let page = &browser.client;

    // The overview counts it; the parked keys' page shows its head.
    page.goto(&console.url("/")).await?;
    let overview = browser.text("main").await?;
    ensure!(overview.contains("1\nparked keys"), "{overview}");
    page.find(Locator::LinkText("Parked keys"))
        .await?
        .click()
        .await?;
    let listed = browser.text_holding("main", "in the dead letters").await?;
    let key = browser.text("main tbody tr td").await?;
    ensure!(key == HELD, "the key as text: {key}");
    ensure!(listed.contains(&event(HELD, 1).event_id), "{listed}");
    ensure!(
        listed.contains(&format!("order {HELD} is poisoned")),
        "{listed}"
    );
    ensure!(page.title().await? != "pwned", "a script ran");
    browser.keep("console-parked").await?;

    // Without the token, no release is offered: a way to log in is.
    no_action_offered(&browser, "release").await?;
    ensure!(env.count_rows("idem_console_audit").await? == 0);
    ensure!(env.count_rows("mq_parked_event").await? == 2);

    // Logged in: the dry run says what a release does, and the release
    // lets the two later events apply without their head.
    browser.log_in(&console).await?;
    env.sql("DROP TRIGGER poison ON user_points").await?;
    page.goto(&console.url("/parked")).await?;
    page.find(Locator::Css("button[value=release]"))
        .await?
        .click()
        .await?;
    browser.text_holding("main", "would release").await?;
    ensure!(
        env.count_rows("mq_parked_event").await? == 2,
        "a dry run changes nothing"
    );
    browser.keep("console-parked-dry-run").await?;
    page.find(Locator::Css("form[action='/parked'] button"))
        .await?
        .click()
        .await?;
    browser.text_holding("main", "released").await?;
    wait_for(
        "the held order's later events",
        Duration::from_secs(30),
        || async { Ok(env.points(HELD).await? == 2) },
    )
    .await?;
    page.goto(&console.url("/parked")).await?;
    browser.text_holding("main", "No key is parked").await?;

    // The audit says who released which key, and how it ended.
    page.goto(&console.url("/audit")).await?;
    let audit = browser.text("main table").await?;
    ensure!(audit.contains("the token's holder (session)"), "{audit}");
    ensure!(audit.contains("release key"), "{audit}");
    ensure!(audit.contains(&format!("key {HELD}")), "{audit}");
    ensure!(audit.contains(&format!("released {HELD}")), "{audit}");
    ensure!(page.title().await? != "pwned", "a script ran");

    browser.close().await?;
    console.stop().await?;
    worker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn html_in_a_body_or_an_error_is_shown_as_text_and_runs_nothing() -> anyhow::Result<()> {
    let Some(browser) = Browser::start().await? else {
        return Ok(());
    };
    let env = TestEnv::new().await?;
    let payload =
        r#"<script>document.title='pwned'</script><img src=x onerror="document.title='pwned'">"#;
    // An error whose text is HTML, from a trigger the event fails on.
    env.sql(&format!(
        "CREATE FUNCTION hostile() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION '%', {}; END $$;
         CREATE TRIGGER hostile BEFORE INSERT OR UPDATE ON user_points
             FOR EACH ROW EXECUTE FUNCTION hostile();",
        quote(payload)
    ))
    .await?;
    let event = PaymentSucceeded {
        event_id: format!("{}-hostile", env.name),
        order_id: "order".into(),
        points: 1,
    };
    let bodies = vec![event.to_body(), payload.as_bytes().to_vec()];
    let worker = dead_lettered(&env, &bodies, 2).await?;
    let console = RunningConsole::start(&env, |_| {}).await?;
    let page = &browser.client;

    page.goto(&console.url("/groups")).await?;
    let groups = browser.text("main").await?;
    ensure!(
        groups.contains("<script>document.title="),
        "the error shown as text: {groups}"
    );
    let letters: Vec<String> = {
        let mut hrefs = Vec::new();
        for link in page
            .find_all(Locator::Css("main a[href^='/letter']"))
            .await?
        {
            hrefs.extend(link.attr("href").await?);
        }
        hrefs
    };
    ensure!(letters.len() == 2, "{letters:?}");
    for href in letters {
        page.goto(&console.url(&href)).await?;
        let text = browser.text("main").await?;
        ensure!(
            text.contains("<script>document.title='pwned'</script>"),
            "{text}"
        );
        ensure!(page.title().await? != "pwned", "a script ran on {href}");
        let images = page.find_all(Locator::Css("main img")).await?;
        ensure!(images.is_empty(), "the payload became an element on {href}");
    }
    ensure!(page.title().await? != "pwned");
    browser.keep("console-hostile-letter").await?;
    console.stop().await?;

    // Logged in on a console that allows edits: the hostile body sits in
    // the edit form as text, and comes back so when the edit is refused.
    let console = RunningConsole::start(&env, |config| config.allow_edits = true).await?;
    browser.log_in(&console).await?;
    let key = idem::store::dead_letters::body_key(payload.as_bytes());
    page.goto(&console.url(&format!("/letter?key={}", key.replace(' ', "+"))))
        .await?;
    page.find(Locator::Css("details.edit summary"))
        .await?
        .click()
        .await?;
    let area = page.find(Locator::Css("form.edit textarea")).await?;
    ensure!(
        area.prop("value").await?.as_deref() == Some(payload),
        "the body in the edit form as it was sent"
    );
    page.find(Locator::Css("form.edit button[type=submit]"))
        .await?
        .click()
        .await?;
    browser.text_holding("main", "nothing was edited").await?;
    let given_back = page
        .find(Locator::Css("form.edit textarea"))
        .await?
        .prop("value")
        .await?;
    ensure!(given_back.as_deref() == Some(payload), "{given_back:?}");
    ensure!(
        page.title().await? != "pwned",
        "a script ran in the edit form"
    );
    let images = page.find_all(Locator::Css("main img")).await?;
    ensure!(
        images.is_empty(),
        "the payload became an element in the edit form"
    );

    browser.close().await?;
    console.stop().await?;
    worker.stop().await?;
    Ok(())
}

/// A PL/pgSQL string literal of `text`.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// What a stranger would try, by hand rather than by browser.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stranger_is_refused_what_the_token_allows() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    let worker = dead_lettered(&env, &[poisoned(&env, 0).to_body()], 1).await?;
    worker.stop().await?;
    let group: uuid::Uuid = env
        .pool
        .get()
        .await?
        .query_one("SELECT group_id FROM mq_dead_letter_group", &[])
        .await?
        .get(0);
    let console = RunningConsole::start(&env, |_| {}).await?;
    // The process's TLS provider, which the client asks for though it speaks plain HTTP.
    let _ = idem::tls::provider().install_default();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let preview = |origin: Option<&str>, bearer: Option<&str>, form_token: &str| {
        let mut request = http
            .post(console.url("/actions/preview"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!(
                "action=replay&group={group}&form_token={form_token}"
            ));
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        request.send()
    };
    let own = format!("http://{}", console.addr);

    // Reading is open on loopback; the page forbids scripts.
    let overview = http.get(console.url("/")).send().await?;
    ensure!(overview.status() == 200);
    let policy = overview.headers()["content-security-policy"]
        .to_str()?
        .to_owned();
    ensure!(policy.contains("default-src 'none'"), "{policy}");
    // Acting without the token, or with a wrong one, is refused.
    ensure!(preview(Some(&own), None, "").await?.status() == 403);
    ensure!(preview(None, Some("not-the-token"), "").await?.status() == 403);
    // The token from another origin is refused, whatever it carries.
    ensure!(
        preview(Some("http://evil.example"), Some(TOKEN), "")
            .await?
            .status()
            == 403
    );
    // A program with the token needs no form token; it gets the dry run.
    let dry_run = preview(None, Some(TOKEN), "").await?;
    ensure!(dry_run.status() == 200);
    ensure!(
        dry_run
            .text()
            .await?
            .contains("events a replay would apply")
    );
    // A browser session without the form token of this console's pages
    // (a forged form) is refused.
    let login = http
        .post(console.url("/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={TOKEN}&form_token=forged"))
        .send()
        .await?;
    ensure!(login.status() == 403, "a login needs the form token too");
    // A parked key's release and discard are refused the same way.
    for path in ["/parked/preview", "/parked"] {
        for (origin, bearer) in [
            (Some(own.as_str()), None),
            (None, Some("not-the-token")),
            (Some("http://evil.example"), Some(TOKEN)),
        ] {
            let mut request = http
                .post(console.url(path))
                .header("content-type", "application/x-www-form-urlencoded")
                .body("action=discard&key=poison-order");
            if let Some(origin) = origin {
                request = request.header("origin", origin);
            }
            if let Some(bearer) = bearer {
                request = request.bearer_auth(bearer);
            }
            let status = request.send().await?.status();
            ensure!(
                status == 403,
                "{path} from {origin:?} with {bearer:?}: {status}"
            );
        }
    }
    ensure!(
        env.count_rows("idem_console_audit").await? == 0,
        "nothing was done"
    );
    console.stop().await?;

    // With bodies hidden, a letter shows its body's size and digest only.
    let console = RunningConsole::start(&env, |config| config.hide_bodies = true).await?;
    let key = format!("event {}", poisoned(&env, 0).event_id);
    let letter = http
        .get(console.url(&format!("/letter?key={}", key.replace(' ', "+"))))
        .send()
        .await?
        .text()
        .await?;
    ensure!(
        letter.contains("Bodies are hidden on this console"),
        "{letter}"
    );
    ensure!(letter.contains("SHA-256"), "{letter}");
    ensure!(!letter.contains("orderId"), "the body is hidden: {letter}");
    console.stop().await?;

    // Beyond loopback, reading needs the token too.
    let console = RunningConsole::start(&env, |config| config.reading_needs_token = true).await?;
    ensure!(http.get(console.url("/groups")).send().await?.status() == 401);
    ensure!(http.get(console.url("/parked")).send().await?.status() == 401);
    let read = http
        .get(console.url("/groups"))
        .bearer_auth(TOKEN)
        .send()
        .await?;
    ensure!(read.status() == 200);
    ensure!(
        read.text()
            .await?
            .contains("order poison-order is poisoned")
    );
    console.stop().await?;
    Ok(())
}

/// `worker --console` serves the pages beside `/metrics`, from the worker's
/// own process and settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_serves_the_console_beside_its_metrics() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    idem::store::migrate::run::<Points>(&env.pool, Some(&env.schema)).await?;
    let port = free_port()?;
    let mut command = idem_command(&env, &amqp_url(), &database_url());
    command.env(idem::vars::CONSOLE_TOKEN, TOKEN).args([
        "worker",
        "--http-addr",
        &format!("127.0.0.1:{port}"),
        "--console",
    ]);
    let worker = WorkerProcess::start(command)?;
    wait_for(
        "the worker's endpoints",
        Duration::from_secs(30),
        || async {
            Ok(http_get(port, "/healthz")
                .await
                .is_ok_and(|(status, _)| status == 200))
        },
    )
    .await?;
    env.publish_bodies(&[b"not an event".to_vec()]).await?;
    wait_for(
        "the dead letter in the console",
        Duration::from_secs(30),
        || async {
            let (status, page) = http_get(port, "/groups").await?;
            Ok(status == 200 && page.contains("not a JSON object"))
        },
    )
    .await?;
    let (status, overview) = http_get(port, "/").await?;
    ensure!(
        status == 200 && overview.contains(&env.topology.dead_letter_queue),
        "{overview}"
    );
    let (status, metrics) = http_get(port, "/metrics").await?;
    ensure!(status == 200 && metrics.contains("deliveries"), "{metrics}");
    worker.stop().await?;
    Ok(())
}

/// Wrong tokens at the login: a few are answered at once, then each try
/// from that address waits longer (429, with Retry-After), the right token
/// too until then; every wrong one is in the audit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_at_the_login_slow_down_and_are_audited() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let console = RunningConsole::start(&env, |_| {}).await?;
    let _ = idem::tls::provider().install_default();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let page = http.get(console.url("/login")).send().await?.text().await?;
    let form_token = page
        .split("name=\"form_token\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .context("the login page's form token")?
        .to_owned();
    let own = format!("http://{}", console.addr);
    let try_token = |token: &str| {
        http.post(console.url("/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", own.as_str())
            .body(format!("token={token}&form_token={form_token}"))
            .send()
    };
    for n in 1..=6 {
        let answer = try_token("guess").await?;
        ensure!(
            answer.status() == 403,
            "wrong token {n}: {}",
            answer.status()
        );
    }
    // The sixth was past the free tries: the next waits, right or wrong.
    let mut retry_after: u64 = 0;
    for token in ["guess", TOKEN] {
        let answer = try_token(token).await?;
        ensure!(answer.status() == 429, "{}", answer.status());
        retry_after = answer.headers()["retry-after"].to_str()?.parse()?;
        ensure!((1..=60).contains(&retry_after), "{retry_after}");
    }
    let audited = env
        .count(
            "SELECT count(*) FROM idem_console_audit WHERE action = 'login' \
             AND outcome LIKE 'refused: a wrong token%'",
            &[],
        )
        .await?;
    ensure!(audited == 6, "{audited} wrong tokens audited");
    // Once the wait is over (the answer says how long), the right token
    // logs in; until then it is still turned away.
    let patience = Duration::from_secs(retry_after + 5);
    wait_for("the right token to log in", patience, || async {
        let status = try_token(TOKEN).await?.status();
        ensure!(status == 429 || status == 303, "{status}");
        Ok(status == 303)
    })
    .await?;
    console.stop().await?;
    Ok(())
}

/// A schema several consumer groups share: the overview names the others,
/// with their dead letters, and how to see each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_names_the_schema_s_other_consumer_groups() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.sql(
        "INSERT INTO mq_failure_ledger (event_id, consumer_group, failures, last_error) \
             VALUES ('e-1', 'billing', 1, 'x'); \
         INSERT INTO mq_slot_member (consumer_group, queue, member) \
             VALUES ('shipping', 'shipping.slot.0', gen_random_uuid()), \
                    ('<script>x</script>', 'q.slot.0', gen_random_uuid());",
    )
    .await?;
    let console = RunningConsole::start(&env, |_| {}).await?;
    let _ = idem::tls::provider().install_default();
    let overview = reqwest::get(console.url("/")).await?.text().await?;
    let others = overview
        .split("Other consumer groups in this schema")
        .nth(1)
        .context("no other groups listed")?;
    for name in ["billing", "shipping"] {
        ensure!(others.contains(&format!("<code>{name}</code>")), "{others}");
    }
    ensure!(
        !others.contains(&format!("<code>{GROUP}</code>")),
        "{others}"
    );
    ensure!(others.contains("console --consumer-group NAME"), "{others}");
    // A group's name is text, never markup.
    ensure!(
        others.contains("<code>&lt;script&gt;x&lt;/script&gt;</code>")
            && !others.contains("<script>"),
        "{others}"
    );
    console.stop().await?;
    Ok(())
}

/// A discard's file, fetched from the action that wrote it: by the token's
/// holder, as an attachment holding the discarded letter; refused to a
/// reader without the token, and not served for an audit row naming a file
/// outside the discard directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_token_s_holder_downloads_a_discard_file_from_its_action() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    let event = poisoned(&env, 0);
    let worker = dead_lettered(&env, &[event.to_body()], 1).await?;
    worker.stop().await?;
    let group: uuid::Uuid = env
        .pool
        .get()
        .await?
        .query_one("SELECT group_id FROM mq_dead_letter_group", &[])
        .await?
        .get(0);
    let console = RunningConsole::start(&env, |_| {}).await?;
    let _discards =
        crate::support::Removed(std::env::temp_dir().join(format!("{}-discarded", env.name)));
    let _ = idem::tls::provider().install_default();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let started = http
        .post(console.url("/actions"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("action=discard&group={group}&expected=1"))
        .send()
        .await?;
    ensure!(started.status() == 303, "{}", started.text().await?);
    let action = started.headers()["location"].to_str()?.to_owned();
    wait_for("the discard to end", Duration::from_secs(30), || async {
        let page = http.get(console.url(&action)).send().await?.text().await?;
        Ok(page.contains("discarded 1"))
    })
    .await?;
    let download = format!("{action}/file");

    // The action's page links it for the token's holder only.
    let as_holder = http
        .get(console.url(&action))
        .bearer_auth(TOKEN)
        .send()
        .await?
        .text()
        .await?;
    ensure!(
        as_holder.contains(&format!("href=\"{download}\"")),
        "{as_holder}"
    );
    let as_reader = http.get(console.url(&action)).send().await?.text().await?;
    ensure!(!as_reader.contains(&download), "{as_reader}");

    let file = http
        .get(console.url(&download))
        .bearer_auth(TOKEN)
        .send()
        .await?;
    ensure!(file.status() == 200, "{}", file.text().await?);
    let disposition = file.headers()["content-disposition"].to_str()?.to_owned();
    ensure!(
        disposition.starts_with("attachment; filename=\"") && disposition.ends_with(".jsonl\""),
        "{disposition}"
    );
    // Streamed from the file, not read into memory first: chunked, with
    // no length known in advance.
    ensure!(
        file.headers()
            .get("transfer-encoding")
            .map(|v| v.as_bytes())
            == Some(b"chunked"),
        "the file not streamed: {:?}",
        file.headers()
    );
    let body = file.text().await?;
    ensure!(
        body.contains(&event.event_id),
        "the discarded letter: {body}"
    );

    // A reader without the token is refused; so is a file the audit names
    // outside the discard directory.
    let refused = http.get(console.url(&download)).send().await?;
    ensure!(refused.status() == 403, "{}", refused.status());
    let id: i64 = action.trim_start_matches("/actions/").parse()?;
    env.sql(&format!(
        "UPDATE idem_console_audit SET file = '/etc/passwd' WHERE id = {id}"
    ))
    .await?;
    let elsewhere = http
        .get(console.url(&download))
        .bearer_auth(TOKEN)
        .send()
        .await?;
    ensure!(elsewhere.status() == 404, "{}", elsewhere.status());
    console.stop().await?;
    Ok(())
}

/// In Chromium: a letter whose body is a script, discarded through the
/// pages once logged in; its action page then offers the file, which the
/// browser takes as a download (the page stays, nothing runs), and a
/// reader who has not logged in is offered no link to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_discards_a_script_body_and_its_file_is_offered_only_once_logged_in()
-> anyhow::Result<()> {
    let Some(browser) = Browser::start().await? else {
        return Ok(());
    };
    let env = TestEnv::new().await?;
    let body = b"<script>document.title='ran'</script>".to_vec();
    let worker = dead_lettered(&env, &[body], 1).await?;
    worker.stop().await?;
    let console = RunningConsole::start(&env, |_| {}).await?;
    let _discards =
        crate::support::Removed(std::env::temp_dir().join(format!("{}-discarded", env.name)));
    let page = &browser.client;

    browser.log_in(&console).await?;
    page.goto(&console.url("/groups")).await?;
    page.find(Locator::Css("main a[href^='/groups/']"))
        .await?
        .click()
        .await?;
    page.find(Locator::Css("button[value=discard]"))
        .await?
        .click()
        .await?;
    browser.text_holding("main", "A discard writes").await?;
    page.find(Locator::Css("form[action='/actions'] button"))
        .await?
        .click()
        .await?;
    browser.text_holding("main", "discarded 1").await?;
    let action = page.current_url().await?;
    let link = page
        .find(Locator::LinkText("download"))
        .await
        .context("the discard file's link, for who may act")?;
    let href = link.attr("href").await?.context("a link")?;
    ensure!(
        href == format!("{}/file", action.path()),
        "{href} beside {action}"
    );
    // Taken as a download: the action page stays, and no script ran.
    link.click().await?;
    browser.text_holding("main", "discarded 1").await?;
    ensure!(page.current_url().await? == action);
    ensure!(page.title().await? != "ran");
    ensure!(env.ready(&env.topology.dead_letter_queue).await? == 0);

    // Logged out, the same page offers no link to the file.
    page.goto(&console.url("/login")).await?;
    page.find(Locator::Css("form[action='/logout'] button"))
        .await?
        .click()
        .await?;
    // Logging out leads to the overview.
    browser.text_holding("main", "dead letters (index)").await?;
    page.goto(action.as_str()).await?;
    browser.text_holding("main", "discarded 1").await?;
    ensure!(
        page.find_all(Locator::LinkText("download"))
            .await?
            .is_empty(),
        "a reader is offered the file"
    );
    browser.close().await?;
    console.stop().await?;
    Ok(())
}

/// The points effect, but an order named `unknown-…` can never apply: the
/// handler says so with [`HandlerError::permanent_for`], its detail naming
/// the order.
struct UnknownOrders;

impl idem::handler::Handler for UnknownOrders {
    type Event = PaymentSucceeded;

    const NAME: &'static str = "points";

    fn decode(&self, body: &[u8]) -> Result<PaymentSucceeded, idem::handler::Invalid> {
        Points.decode(body)
    }

    fn event_id<'e>(&self, event: &'e PaymentSucceeded) -> &'e str {
        &event.event_id
    }

    async fn apply(
        &self,
        tx: &idem::handler::Transaction<'_>,
        events: &[&PaymentSucceeded],
        outbox: &mut idem::handler::Outbox<'_>,
    ) -> Result<(), idem::handler::HandlerError> {
        if let Some(unknown) = events.iter().find(|e| e.order_id.starts_with("unknown-")) {
            return Err(idem::handler::HandlerError::permanent_for(
                "no such order",
                format!("order {} of {}", unknown.order_id, unknown.event_id),
            ));
        }
        Points.apply(tx, events, outbox).await
    }
}

/// A letter's page shows the handler's detail of its failure beside the
/// error that groups it, as the worker wrote it and again once a sync has
/// rebuilt the index from the queue (the dead-letter copy carries it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_letter_shows_the_handler_s_detail_beside_its_error() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let events: Vec<PaymentSucceeded> = ["unknown-7", "unknown-8"]
        .iter()
        .enumerate()
        .map(|(i, order)| PaymentSucceeded {
            event_id: format!("{}-unknown-{i}", env.name),
            order_id: (*order).into(),
            points: 1,
        })
        .collect();
    let bodies: Vec<Vec<u8>> = events.iter().map(PaymentSucceeded::to_body).collect();
    env.publish_bodies(&bodies).await?;
    let worker = RunningWorker::start_with(env.worker_config(Mode::Batch), UnknownOrders);
    wait_for("the dead letters", Duration::from_secs(30), || async {
        Ok(env.ready(&env.topology.dead_letter_queue).await? == 2)
    })
    .await?;
    worker.stop().await?;
    let console = RunningConsole::start(&env, |_| {}).await?;
    let pages = || async {
        let mut pages = Vec::new();
        for event in &events {
            let key = idem::store::dead_letters::event_key(&event.event_id);
            let path = format!("/letter?key={}", key.replace(' ', "%20"));
            let (status, page) = http_get(console.addr.port(), &path).await?;
            ensure!(status == 200, "{status} for {path}: {page}");
            pages.push(page);
        }
        anyhow::Ok(pages)
    };
    for (page, event) in pages().await?.iter().zip(&events) {
        ensure!(page.contains("no such order"), "{page}");
        ensure!(
            page.contains(&format!(
                "the handler's detail: <q>order {} of {}</q>",
                event.order_id, event.event_id
            )),
            "{page}"
        );
    }

    env.sql("DELETE FROM mq_dead_letter").await?;
    let sync = crate::support::run_idem(&env, &["dlq", "sync"]).await?;
    ensure!(sync.code == Some(0), "dlq sync: {}", sync.stderr);
    for (page, event) in pages().await?.iter().zip(&events) {
        ensure!(
            page.contains(&format!(
                "<q>order {} of {}</q>",
                event.order_id, event.event_id
            )),
            "after a sync: {page}"
        );
    }
    console.stop().await?;
    Ok(())
}

/// `event`'s body with its order `order` and its points `points`, as a
/// producer's JSON.
fn body_of(event: &PaymentSucceeded, order: &str, points: &str) -> String {
    format!(
        r#"{{"eventId": "{}", "orderId": "{order}", "points": {points}}}"#,
        event.event_id
    )
}

/// In Chromium, edit and retry end to end: a letter whose order is wrong
/// is edited by the token's holder (an edit the handler cannot decode is
/// refused first, the form given back), sent in place of the letter with
/// a header naming it, applied once; the letter is gone from the dead
/// letters and the audit shows both bodies. A reader is offered no edit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_edits_a_letter_s_body_and_its_event_applies_once() -> anyhow::Result<()> {
    let Some(browser) = Browser::start().await? else {
        return Ok(());
    };
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    let event = PaymentSucceeded {
        points: 3,
        ..poisoned(&env, 0)
    };
    let worker = dead_lettered(&env, &[event.to_body()], 1).await?;
    worker.stop().await?;
    let console = RunningConsole::start(&env, |config| config.allow_edits = true).await?;
    let page = &browser.client;
    let key = format!("event {}", event.event_id);
    let letter_url = console.url(&format!("/letter?key={}", key.replace(' ', "+")));

    page.goto(&letter_url).await?;
    ensure!(
        page.find_all(Locator::Css("form.edit")).await?.is_empty(),
        "an edit offered to a reader"
    );
    browser.log_in(&console).await?;
    page.goto(&letter_url).await?;
    page.find(Locator::Css("details.edit summary"))
        .await?
        .click()
        .await?;
    let edit = |body: String| async move {
        let area = page.find(Locator::Css("form.edit textarea")).await?;
        area.clear().await?;
        area.send_keys(&body).await?;
        page.find(Locator::Css("form.edit button[type=submit]"))
            .await?
            .click()
            .await?;
        anyhow::Ok(())
    };
    // Without its points, the handler cannot decode it: refused, the form
    // given back with the edit in it.
    let undecodable = format!(
        r#"{{"eventId": "{}", "orderId": "mended-order"}}"#,
        event.event_id
    );
    edit(undecodable).await?;
    browser
        .text_holding("main", "the handler cannot decode the edited body")
        .await?;
    let kept = page
        .find(Locator::Css("form.edit textarea"))
        .await?
        .prop("value")
        .await?
        .unwrap_or_default();
    ensure!(kept.contains("mended-order"), "the edit given back: {kept}");
    edit(body_of(&event, "mended-order", "3")).await?;
    browser.text_holding("main", "Sent in its place").await?;
    browser.keep("console-edit").await?;
    page.find(Locator::XPath(
        "//button[contains(., 'Send the edited letter')]",
    ))
    .await?
    .click()
    .await?;
    browser.text_holding("main", "replayed 1").await?;
    let action = browser.text("main").await?;
    ensure!(
        action.contains("\"orderId\": \"poison-order\"")
            && action.contains("\"orderId\": \"mended-order\""),
        "the action shows both bodies: {action}"
    );

    // In the work queue: the edit, naming the letter it replaces.
    let sent = env.peek(&env.topology.queue).await?;
    ensure!(sent.len() == 1, "{} messages sent", sent.len());
    let sent_body: serde_json::Value = serde_json::from_slice(&sent[0].body)?;
    ensure!(sent_body["orderId"] == "mended-order", "{sent_body}");
    let replaces = sent[0]
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(idem::broker::death::REPLACES_HEADER).cloned());
    ensure!(
        replaces == Some(lapin::types::AMQPValue::LongString(key.as_str().into())),
        "{replaces:?}"
    );
    ensure!(env.ready(&env.topology.dead_letter_queue).await? == 0);
    ensure!(env.count_rows("mq_dead_letter").await? == 0);

    // Applied once; the original, published again, is a duplicate.
    let worker = RunningWorker::start(env.worker_config(Mode::Batch));
    wait_for(
        "the edited event applied",
        Duration::from_secs(30),
        || async { Ok(env.points("mended-order").await? == 3) },
    )
    .await?;
    env.publish_bodies(&[event.to_body()]).await?;
    wait_for("the original taken", Duration::from_secs(30), || async {
        Ok(env.ready(&env.topology.queue).await? == 0 && env.messages(&env.topology.queue)? == 0)
    })
    .await?;
    worker.stop().await?;
    ensure!(env.points("mended-order").await? == 3);
    ensure!(env.points("poison-order").await? == 0);
    ensure!(env.records_of(&event.event_id, GROUP).await? == 1);
    ensure!(env.ready(&env.topology.dead_letter_queue).await? == 0);

    // The audit keeps both bodies.
    let audit = env
        .pool
        .get()
        .await?
        .query_one(
            "SELECT action, body_before, body_after, letters FROM idem_console_audit \
             WHERE action = 'edit'",
            &[],
        )
        .await?;
    let before: Vec<u8> = audit.get(1);
    let after: Vec<u8> = audit.get(2);
    ensure!(
        before == event.to_body(),
        "{}",
        String::from_utf8_lossy(&before)
    );
    ensure!(
        String::from_utf8_lossy(&after).contains("mended-order"),
        "{}",
        String::from_utf8_lossy(&after)
    );
    ensure!(audit.get::<_, Option<i64>>(3) == Some(1));
    browser.close().await?;
    console.stop().await?;
    Ok(())
}

/// What a stranger would try against edit and retry: without the token,
/// with a wrong one, from another origin, a body the handler cannot
/// decode, an edit that changes the event id, and any edit on a console
/// that does not allow them. Each is refused, the letter stays, and the
/// audit records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_edit_is_refused_to_strangers_and_for_bodies_the_handler_refuses() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    env.poison_order("poison-order").await?;
    let event = poisoned(&env, 0);
    let worker = dead_lettered(&env, &[event.to_body()], 1).await?;
    worker.stop().await?;
    let _ = idem::tls::provider().install_default();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let key = format!("event {}", event.event_id);
    let mended = body_of(&event, "mended-order", "1");
    let other_id = r#"{"eventId": "another-event", "orderId": "mended-order", "points": 1}"#;
    let post = |console: &RunningConsole,
                path: &str,
                origin: Option<&str>,
                bearer: Option<&str>,
                body: &str| {
        let form = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("key", &key)
            .append_pair("body", body)
            .append_pair("form_token", "forged")
            .finish();
        let mut request = http
            .post(console.url(path))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form);
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        request.send()
    };

    let console = RunningConsole::start(&env, |config| config.allow_edits = true).await?;
    let own = format!("http://{}", console.addr);
    for path in ["/edits/preview", "/edits"] {
        for (origin, bearer, body, status, says) in [
            (Some(own.as_str()), None, mended.as_str(), 403, ""),
            (None, Some("not-the-token"), mended.as_str(), 403, ""),
            (
                Some("http://evil.example"),
                Some(TOKEN),
                mended.as_str(),
                403,
                "",
            ),
            (None, Some(TOKEN), "{\"eventId\": 1", 422, "cannot decode"),
            (None, Some(TOKEN), other_id, 422, "changes the event id"),
        ] {
            let response = post(&console, path, origin, bearer, body).await?;
            let got = response.status();
            let text = response.text().await?;
            ensure!(
                got == status && text.contains(says),
                "{path} from {origin:?} with {bearer:?}, {body}: {got} {text}"
            );
        }
    }
    // The token's holder gets the check, which sends nothing.
    let checked = post(&console, "/edits/preview", None, Some(TOKEN), &mended).await?;
    ensure!(checked.status() == 200);
    ensure!(checked.text().await?.contains("Sent in its place"));
    console.stop().await?;

    // A console that does not allow edits offers none and takes none.
    let console = RunningConsole::start(&env, |_| {}).await?;
    let letter = http
        .get(console.url(&format!("/letter?key={}", key.replace(' ', "+"))))
        .bearer_auth(TOKEN)
        .send()
        .await?
        .text()
        .await?;
    ensure!(letter.contains("Replay this letter"), "{letter}");
    ensure!(!letter.contains("Edit and retry"), "{letter}");
    let refused = post(&console, "/edits", None, Some(TOKEN), &mended).await?;
    ensure!(refused.status() == 403, "{}", refused.status());
    console.stop().await?;

    ensure!(env.ready(&env.topology.dead_letter_queue).await? == 1);
    ensure!(env.count_rows("mq_dead_letter").await? == 1);
    ensure!(env.count_rows("idem_console_audit").await? == 0);
    ensure!(env.ready(&env.topology.queue).await? == 0);
    Ok(())
}

/// Given a certificate and its key, the console serves HTTPS and nothing in
/// plain text: a client that trusts the certificate reads the pages and
/// logs in, getting a `Secure` session cookie; a plain HTTP request to the
/// same port gets no page. A key that is not one is refused at start,
/// naming the file and nothing of what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_certificate_the_console_serves_https_only() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dir = std::env::temp_dir().join(format!("{}-console-tls", env.name));
    std::fs::create_dir_all(&dir)?;
    let _dir = crate::support::Removed(dir.clone());
    let issued = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()])?;
    let (certificate, key) = (dir.join("console.pem"), dir.join("console-key.pem"));
    std::fs::write(&certificate, issued.cert.pem())?;
    std::fs::write(&key, issued.signing_key.serialize_pem())?;
    let tls = idem::console::ConsoleTls::from_pem_files(&certificate, &key)?;
    let console = RunningConsole::start(&env, |config| config.tls = Some(tls)).await?;
    let origin = format!("https://{}", console.addr);

    let _ = idem::tls::provider().install_default();
    let https = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .tls_certs_only([reqwest::Certificate::from_pem(
            issued.cert.pem().as_bytes(),
        )?])
        .build()?;
    let overview = https.get(format!("{origin}/")).send().await?;
    ensure!(overview.status() == 200, "{}", overview.status());
    ensure!(overview.text().await?.contains("dead letters"));
    let login_page = https
        .get(format!("{origin}/login"))
        .send()
        .await?
        .text()
        .await?;
    let form_token = login_page
        .split("name=\"form_token\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .context("the login page's form token")?
        .to_owned();
    let logged_in = https
        .post(format!("{origin}/login"))
        .header("origin", &origin)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={TOKEN}&form_token={form_token}"))
        .send()
        .await?;
    ensure!(logged_in.status() == 303, "{}", logged_in.status());
    let cookie = logged_in.headers()["set-cookie"].to_str()?.to_owned();
    ensure!(
        cookie.contains("HttpOnly") && cookie.ends_with("; Secure"),
        "{cookie}"
    );

    // Plain HTTP on the same port: no page.
    let plain = reqwest::Client::new()
        .get(console.url("/"))
        .timeout(patient(Duration::from_secs(10)))
        .send()
        .await;
    ensure!(plain.is_err(), "a page over plain HTTP: {plain:?}");
    console.stop().await?;

    // A file that holds no key is named; what it holds is not shown.
    std::fs::write(&key, "not a key, but a secret")?;
    let refused = idem::console::ConsoleTls::from_pem_files(&certificate, &key)
        .expect_err("a key file without a key");
    let said = refused.to_string();
    ensure!(
        said.contains(&key.display().to_string()) && !said.contains("secret"),
        "{said}"
    );
    Ok(())
}
