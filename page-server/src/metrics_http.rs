//! `GET /metrics` and `GET /ready` (`readiness.rs`) on their own listener
//! (`--metrics-listen`): a minimal HTTP/1.1 answer per connection, one
//! connection at a time, each bounded by a read and a write timeout so that
//! a stuck scraper cannot hold it.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::readiness::Standing;
use crate::registration::RegisteredWatch;
use crate::server::Shared;

/// A request head larger than this is refused.
const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Reading a request head and writing the answer each get this long.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// The metrics listener and its thread.
#[derive(Debug)]
pub(crate) struct MetricsEndpoint {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsEndpoint {
    /// Binds `listen` and serves the metrics of `shared`, and its readiness
    /// (`registered`: the registration, `None` without a coordinator).
    pub fn start(
        listen: SocketAddr,
        shared: Arc<Shared>,
        registered: Option<RegisteredWatch>,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("page-server-metrics".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if thread_stop.load(Ordering::SeqCst) {
                        break;
                    }
                    match stream {
                        Ok(stream) => {
                            if let Err(error) = answer(stream, &shared, registered.as_ref()) {
                                tracing::debug!(%error, "metrics request failed");
                            }
                        }
                        Err(error) => tracing::debug!(%error, "metrics accept failed"),
                    }
                }
            })?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and joins the thread.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let wake = if self.addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], self.addr.port()))
        } else {
            self.addr
        };
        // Wakes the blocking accept; it then sees the flag.
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Reads one request head and answers it, then closes.
fn answer(
    mut stream: TcpStream,
    shared: &Shared,
    registered: Option<&RegisteredWatch>,
) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_HEAD_BYTES {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            );
        }
        let read = stream.read(&mut chunk)?;
        if read == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..read]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, target) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    const ROUTES: &str = "GET /metrics\nGET /ready\n";
    if path != b"/metrics" && path != b"/ready" {
        return respond(&mut stream, "404 Not Found", "text/plain", ROUTES);
    }
    if method != b"GET" {
        return respond(&mut stream, "405 Method Not Allowed", "text/plain", ROUTES);
    }
    if path == b"/ready" {
        let standing = registered.map(|watch| match watch.standing() {
            Standing::Registered if shared.exported.self_fence.is_fenced() => Standing::Fenced,
            standing => standing,
        });
        let report = crate::readiness::readiness(standing, shared.seen.each());
        let status = if report.ready {
            "200 OK"
        } else {
            "503 Service Unavailable"
        };
        return respond(
            &mut stream,
            status,
            "text/plain; charset=utf-8",
            &report.text,
        );
    }
    let mut stats = shared.admission.stats();
    shared.recovery.fill(&mut stats);
    shared.fill_fence(&mut stats);
    if let Some(watch) = registered {
        watch.fill(&mut stats);
    }
    let coherence = shared.exported.coherence.snapshot();
    match shared.exported.metrics.render(&stats, &coherence) {
        Ok(text) => respond(
            &mut stream,
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            &text,
        ),
        Err(_) => respond(&mut stream, "500 Internal Server Error", "text/plain", ""),
    }
}

fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}
