//! The printed table and the JSON record of each run.

use serde::Serialize;

use crate::workload::{AccessPattern, Op, Outcome, Spec};

/// Latency percentiles in microseconds.
#[derive(Debug, Serialize)]
pub struct LatencyUs {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

/// Throughput of a run.
#[derive(Debug, Serialize)]
pub struct Throughput {
    pub pages_per_s: f64,
    pub gb_per_s: f64,
}

/// One benchmark run, as written to `--json`.
#[derive(Debug, Serialize)]
pub struct Record {
    /// `tcp`, `rdma`, or `bare-tcp` for the baseline.
    pub transport: String,
    pub op: Op,
    pub pattern: AccessPattern,
    pub ops: u64,
    pub threads: usize,
    pub depth: usize,
    pub nodes: usize,
    /// Holders of each range (`--replicas`; 1 for an existing cluster).
    pub replicas: usize,
    pub errors: u64,
    pub verified: bool,
    pub latency_us: LatencyUs,
    pub throughput: Throughput,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// Baselines only: the layout of the run this record holds (the one
    /// with the lowest p50, see bench/src/baseline/mod.rs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// Baselines only: every layout tried in this run, the chosen one included.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layouts: Vec<LayoutResult>,
    /// `--fail-node-after-ms` only: the failure and what the run saw of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<crate::failure::FailureReport>,
    /// Our read/write runs: the library call that moved the pages (`copy`:
    /// `read_pages`/`write_pages`, `frame`: `read_frame`, writes copy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api: Option<String>,
    /// Our runs: where the library's threads ran and how they waited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// `--op fault` only: what guest memory was made of (`anon`, `memfd`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backing: Option<String>,
    /// `--op fault` only: whether RDMA moved the region's pages straight
    /// into and out of guest RAM (a shared backing whose alias is
    /// registered with the device), rather than through the pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdma_zero_copy: Option<bool>,
    /// Our TCP runs: pages whose answer was read from the socket straight
    /// into their destination (guest memory, or the caller's page), with no
    /// copy out of a receive buffer (asynchronous reads alone in flight on
    /// their connection; every other TCP answer is copied once).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_direct_pages: Option<u64>,
    /// Read runs against the local cluster: checksummed READ answers its
    /// page-servers sent straight out of their region with the sum kept
    /// since the page was written (every other checksummed answer is a copy
    /// of the page, summed when taken).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_kept_sum_reads: Option<u64>,
    /// Flush runs only: how dirty pages were found (`wp-faults`: a
    /// userfaultfd write-protect fault on each first write).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_tracking: Option<String>,
}

/// The thread placement and waiting a run of ours used (the bench passes
/// them to the library explicitly; the library's defaults neither pin nor
/// busy-poll).
#[derive(Debug, Clone, Serialize)]
pub struct Placement {
    /// `busy` or `event`.
    pub poll_mode: String,
    /// CPUs the pollers are pinned to; empty: not pinned.
    pub poller_cpus: Vec<usize>,
    /// How long a caller reads its own answers before it blocks (busy
    /// mode only; event mode blocks at once).
    pub wait_spin_us: u64,
    /// The local page-servers' spin before they block (absent with
    /// `--coordinator`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_server_spin_us: Option<u64>,
    /// CPUs the guest-memory fault handlers are pinned to (`--op fault`
    /// only); empty: not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handler_cpus: Option<Vec<usize>>,
    /// The scheduler slice the fault handlers ask for (`--op fault` only;
    /// 0: the kernel's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handler_slice_us: Option<u64>,
    /// CPUs of the faulting threads (`--op fault` only): thread t on entry
    /// t (mod the length); empty: not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub toucher_cpus: Option<Vec<usize>>,
    /// CPUs the local page-servers' connection threads are pinned to, when
    /// `--page-server-cpus` gives them; empty: not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_server_cpus: Option<Vec<usize>>,
    /// The CPU the measured caller thread (and every thread it starts) is
    /// pinned to: one caller of a read or write run, on a CPU no poller
    /// and no local page-server is pinned to, where the bare client runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caller_cpu: Option<usize>,
}

impl Placement {
    /// One line for the terminal.
    pub fn describe(&self) -> String {
        let cpus = if self.poller_cpus.is_empty() {
            "not pinned".to_owned()
        } else {
            format!("pinned to CPU {:?}", self.poller_cpus)
        };
        let spin = match self.poll_mode.as_str() {
            "busy" => format!("callers spin {} us then block", self.wait_spin_us),
            _ => "callers block at once".to_owned(),
        };
        let server = self
            .page_server_spin_us
            .map(|us| format!(", local page-servers spin {us} us then block"))
            .unwrap_or_default();
        let handlers = match self.handler_cpus.as_deref() {
            None => String::new(),
            Some([]) => ", fault handlers not pinned".to_owned(),
            Some(cpus) => format!(", fault handlers pinned to CPU {cpus:?}"),
        };
        let slice = match self.handler_slice_us {
            None | Some(0) => String::new(),
            Some(us) => format!(" asking for a {us} us slice"),
        };
        let touchers = match self.toucher_cpus.as_deref() {
            None => String::new(),
            Some([]) => ", faulting threads not pinned".to_owned(),
            Some(cpus) => format!(", faulting threads on CPU {cpus:?}"),
        };
        let servers = match self.page_server_cpus.as_deref() {
            None => String::new(),
            Some([]) => ", local page-servers not pinned".to_owned(),
            Some(cpus) => format!(", local page-servers pinned to CPU {cpus:?}"),
        };
        let caller = self
            .caller_cpu
            .map(|cpu| format!(", the caller pinned to CPU {cpu}"))
            .unwrap_or_default();
        format!(
            "placement: poll mode {}, pollers {cpus}, {spin}{server}{handlers}{slice}{touchers}{servers}{caller}",
            self.poll_mode
        )
    }
}

/// One layout of the bare ping-pong, as tried for the baseline.
#[derive(Debug, Clone, Serialize)]
pub struct LayoutResult {
    pub layout: String,
    pub client_cpu: usize,
    pub server_cpu: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub pages_per_s: f64,
    pub verified: bool,
}

impl LayoutResult {
    pub fn new(layout: &str, (client_cpu, server_cpu): (usize, usize), outcome: &Outcome) -> Self {
        let h = &outcome.latency_ns;
        Self {
            layout: layout.into(),
            client_cpu,
            server_cpu,
            p50_us: h.value_at_quantile(0.50) as f64 / 1000.0,
            p99_us: h.value_at_quantile(0.99) as f64 / 1000.0,
            pages_per_s: outcome.ops_done as f64 / outcome.elapsed.as_secs_f64().max(1e-9),
            verified: outcome.verified(),
        }
    }
}

impl Record {
    pub fn new(transport: &str, spec: Spec, nodes: usize, outcome: &Outcome) -> Self {
        let h = &outcome.latency_ns;
        let us = |ns: u64| ns as f64 / 1000.0;
        let secs = outcome.elapsed.as_secs_f64().max(1e-9);
        let ok_pages = (outcome.ops_done - outcome.errors) as f64;
        Self {
            transport: transport.into(),
            op: spec.op,
            pattern: spec.pattern,
            ops: outcome.ops_done,
            threads: spec.threads,
            depth: spec.depth,
            nodes,
            replicas: 1,
            errors: outcome.errors,
            verified: outcome.verified(),
            latency_us: LatencyUs {
                p50: us(h.value_at_quantile(0.50)),
                p90: us(h.value_at_quantile(0.90)),
                p99: us(h.value_at_quantile(0.99)),
                p999: us(h.value_at_quantile(0.999)),
                max: us(h.max()),
                mean: h.mean() / 1000.0,
            },
            throughput: Throughput {
                pages_per_s: ok_pages / secs,
                gb_per_s: ok_pages * rdma_transport::PAGE_SIZE as f64 / secs / 1e9,
            },
            first_error: outcome.first_error.clone(),
            layout: None,
            layouts: Vec::new(),
            failure: None,
            api: None,
            placement: None,
            backing: None,
            rdma_zero_copy: None,
            tcp_direct_pages: None,
            server_kept_sum_reads: None,
            dirty_tracking: None,
        }
    }

    /// The record of a best-of-layouts baseline (`transport` `bare-tcp`):
    /// the chosen layout's figures, every layout's p50, and `verified` only
    /// when every layout's pages were right.
    pub fn baseline(spec: Spec, best: &crate::baseline::Best) -> Self {
        let mut r = Self::new("bare-tcp", spec, 1, &best.outcome);
        r.verified &= best.all_verified;
        r.layout = Some(best.layout.name().into());
        r.layouts = best.tried.clone();
        r
    }

    /// The record of the bare pipelined client (`bare-tcp-pipelined`): the
    /// layout with the highest throughput, every layout's figures.
    pub fn pipelined(spec: Spec, best: &crate::baseline::Best) -> Self {
        let mut r = Self::baseline(spec, best);
        r.transport = "bare-tcp-pipe".into();
        r
    }
}

/// A latency in microseconds for the table: one decimal, or three (the
/// histogram's nanoseconds) below 1 us, so a prefetched page's 0.04 us does
/// not print as 0.0.
pub fn fmt_us(us: f64) -> String {
    if us < 1.0 {
        format!("{us:.3}")
    } else {
        format!("{us:.1}")
    }
}

/// The table's header line.
pub fn header() -> String {
    format!(
        "{:<15} {:<5} {:<6} {:>3} {:>3} {:<5} {:>8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>6} {:>8}",
        "transport", "op", "order", "thr", "dep", "api", "ops", "errors", "p50_us", "p90_us", "p99_us", "p999_us", "max_us",
        "pages/s", "GB/s", "verified"
    )
}

/// One table line.
pub fn line(r: &Record) -> String {
    let order = match r.pattern {
        AccessPattern::Random => "random",
        AccessPattern::Seq => "seq",
    };
    let op = match r.op {
        Op::Read => "read",
        Op::Write => "write",
        Op::Fault => "fault",
        Op::Coherence => "coh",
    };
    let l = &r.latency_us;
    format!(
        "{:<15} {:<5} {:<6} {:>3} {:>3} {:<5} {:>8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10.0} {:>6.2} {:>8}",
        r.transport,
        op,
        order,
        r.threads,
        r.depth,
        r.api.as_deref().unwrap_or("-"),
        r.ops,
        r.errors,
        fmt_us(l.p50),
        fmt_us(l.p90),
        fmt_us(l.p99),
        fmt_us(l.p999),
        fmt_us(l.max),
        r.throughput.pages_per_s,
        r.throughput.gb_per_s,
        if r.verified { "yes" } else { "NO" }
    )
}

/// The failure a run saw, on one line (nothing without one).
pub fn failure_line(r: &Record) -> Option<String> {
    let f = r.failure.as_ref()?;
    let kinds: Vec<String> = f
        .errors_by_kind
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let s = &f.spanned;
    let mut line = format!(
        "failure ({:?} {:?}, {} replicas): {} stopped at {:.1} ms{}; errors {} ({}); verified pages {}; \
         {} pages started in [{}, +{}] ms around it: {} failed, p50 {} us, p99 {} us, max {} us",
        r.op,
        r.pattern,
        r.replicas,
        f.node,
        f.at_ms,
        if f.during_run { "" } else { " (after the run ended)" },
        r.errors,
        if kinds.is_empty() { "none".into() } else { kinds.join(", ") },
        f.verified_pages,
        s.pages,
        s.window_ms[0],
        s.window_ms[1],
        s.errors,
        fmt_us(s.p50_us),
        fmt_us(s.p99_us),
        fmt_us(s.max_us),
    );
    if let Some(b) = &f.bound {
        line.push_str(&format!(
            " ({} bound: p99 < 2 x hedge {} us + round trip {} us = {} us, max < deadline {} us)",
            if b.within {
                "within the"
            } else {
                "OUTSIDE the"
            },
            fmt_us(b.hedge_delay_us),
            fmt_us(b.round_trip_us),
            fmt_us(b.p99_bound_us),
            fmt_us(b.request_timeout_us),
        ));
    }
    if let Some(rb) = &f.readback {
        line.push_str(&format!(
            "; read back {} pages: {} lost acknowledged writes, {} wrong, {} unreadable",
            rb.pages_checked, rb.lost_acked, rb.wrong, rb.unreadable
        ));
    }
    Some(line)
}

/// Our figures against the baseline's, as ratios (>1 means we are slower).
/// p50 is against the baseline record (the layout with the lowest p50);
/// p99 and throughput against the best of any layout tried, named, because
/// the lowest-p50 layout may have a poor tail (a spinning thread preempted
/// on a busy host) and a ratio against that would flatter us.
pub fn ratio_line(ours: &Record, base: &Record) -> String {
    let name = |l: Option<&LayoutResult>| l.map_or("-", |l| l.layout.as_str()).to_owned();
    let best_p99 = base
        .layouts
        .iter()
        .min_by(|a, b| a.p99_us.total_cmp(&b.p99_us));
    let best_rate = base
        .layouts
        .iter()
        .max_by(|a, b| a.pages_per_s.total_cmp(&b.pages_per_s));
    let p99 = best_p99.map_or(base.latency_us.p99, |l| l.p99_us);
    let rate = best_rate.map_or(base.throughput.pages_per_s, |l| l.pages_per_s);
    format!(
        "overhead vs bare TCP ({:?} {:?}, depth {}): p50 x{} ({}), p99 x{} ({}), throughput x{} ({})",
        ours.op,
        ours.pattern,
        ours.depth,
        fmt_ratio(ours.latency_us.p50 / base.latency_us.p50.max(1e-9)),
        base.layout.as_deref().unwrap_or("-"),
        fmt_ratio(ours.latency_us.p99 / p99.max(1e-9)),
        name(best_p99),
        fmt_ratio(ours.throughput.pages_per_s / rate.max(1e-9)),
        name(best_rate),
    )
}

/// Our one-page-in-flight figures against the bare ping-pong whose pages
/// are spread over `servers` servers as ours are over our nodes (the same
/// job on the same CPUs), as [`ratio_line`] does against one server.
pub fn spread_ratio_line(ours: &Record, base: &Record, servers: usize) -> String {
    let line = ratio_line(ours, base);
    let rest = line.strip_prefix("overhead vs bare TCP").unwrap_or(&line);
    format!("overhead vs bare TCP over {servers} servers, pages spread as over our nodes{rest}")
}

/// [`layouts_line`] of the spread baseline of [`spread_ratio_line`].
pub fn spread_layouts_line(base: &Record, servers: usize) -> String {
    let line = layouts_line(base);
    let rest = line.strip_prefix("bare TCP baseline").unwrap_or(&line);
    format!("bare TCP baseline over {servers} servers, all on the server CPU{rest}")
}

/// Our many-in-flight throughput against the bare pipelined client's
/// (its best layout), both from this run.
pub fn pipelined_line(ours: &Record, base: &Record) -> String {
    format!(
        "throughput vs bare pipelined TCP ({:?} {:?}, depth {}): ours {:.2} GB/s vs bare {:.2} GB/s ({}; p50 {} us): x{} (layouts: {})",
        ours.op,
        ours.pattern,
        ours.depth,
        ours.throughput.gb_per_s,
        base.throughput.gb_per_s,
        base.layout.as_deref().unwrap_or("-"),
        fmt_us(base.latency_us.p50),
        fmt_ratio(ours.throughput.gb_per_s / base.throughput.gb_per_s.max(1e-12)),
        base.layouts
            .iter()
            .map(|l| format!(
                "{} {:.2} GB/s",
                l.layout,
                l.pages_per_s * rdma_transport::PAGE_SIZE as f64 / 1e9
            ))
            .collect::<Vec<_>>()
            .join(", "),
    )
}

/// The median (mean of the middle two for an even count); 0 for none.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A ratio: two decimals, or three significant digits below 0.1 (a
/// prefetched page against a whole fault is x0.00123, not x0.00).
/// Ratios separated by spaces, as [`fmt_ratio`] prints each.
pub fn fmt_ratios(ratios: &[f64]) -> String {
    ratios
        .iter()
        .map(|&r| fmt_ratio(r))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Microseconds separated by spaces, as [`fmt_us`] prints each.
pub fn fmt_us_all(us: impl IntoIterator<Item = f64>) -> String {
    us.into_iter().map(fmt_us).collect::<Vec<_>>().join(" ")
}

pub fn fmt_ratio(r: f64) -> String {
    if r < 0.1 {
        format!("{r:.2e}")
    } else {
        format!("{r:.2}")
    }
}

/// Which layout the baseline used and every layout's p50 and p99.
pub fn layouts_line(base: &Record) -> String {
    let tried: Vec<String> = base
        .layouts
        .iter()
        .map(|l| format!("{} {}/{} us", l.layout, fmt_us(l.p50_us), fmt_us(l.p99_us)))
        .collect();
    let what = match base.op {
        Op::Fault => format!("bare remote fault ({:?})", base.pattern),
        op => format!(
            "bare TCP baseline ({op:?} {:?}, depth {})",
            base.pattern, base.depth
        ),
    };
    format!(
        "{what}: best layout {} of {} (p50/p99: {})",
        base.layout.as_deref().unwrap_or("-"),
        base.layouts.len(),
        tried.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_microsecond_latencies_stay_readable() {
        assert_eq!(fmt_us(0.041), "0.041");
        assert_eq!(fmt_us(0.0), "0.000");
        assert_eq!(fmt_us(25.84), "25.8");
        assert_eq!(fmt_us(1.0), "1.0");
        assert_eq!(fmt_ratio(1.234), "1.23");
        assert_eq!(fmt_ratio(0.00123), "1.23e-3");
    }

    #[test]
    fn spread_lines_name_their_servers() {
        let spec = Spec {
            op: Op::Read,
            ops: 1,
            threads: 1,
            depth: 1,
            pattern: AccessPattern::Random,
        };
        let outcome = |ns: u64| {
            let mut latency_ns = crate::workload::new_histogram();
            latency_ns.record(ns).expect("in range");
            Outcome {
                latency_ns,
                elapsed: std::time::Duration::from_millis(1),
                ops_done: 1,
                errors: 0,
                bad_pages: 0,
                pages_checked: 1,
                first_error: None,
            }
        };
        let ours = Record::new("tcp", spec, 2, &outcome(12_000));
        let base = Record::new("bare-tcp", spec, 1, &outcome(10_000));
        let line = spread_ratio_line(&ours, &base, 2);
        assert!(
            line.starts_with(
                "overhead vs bare TCP over 2 servers, pages spread as over our nodes (Read Random, depth 1): p50 x1.20"
            ),
            "{line}"
        );
        let line = spread_layouts_line(&base, 2);
        assert!(
            line.starts_with(
                "bare TCP baseline over 2 servers, all on the server CPU (Read Random, depth 1)"
            ),
            "{line}"
        );
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}
