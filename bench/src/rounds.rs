//! What the rounds modes share: the job whose runs of ours
//! `--latency-rounds` and `--throughput-rounds` repeat, and the check
//! (theirs and `--fault-rounds`') that a run moved only right pages.

use std::time::Duration;

use indicatif::ProgressBar;
use rdma_transport::TransportManager;

use crate::baseline;
use crate::cluster::{self, LocalCluster};
use crate::workload::{self, Api, Op, Spec, WorkingSet};

/// What the rounds run: `spec` (one thread; one page in flight in
/// `latency_rounds`, many in `throughput_rounds`) with `seed` over `set`,
/// through `api`; `owners` as `WorkingSet::owners`.
pub struct Job<'a> {
    pub mgr: &'a TransportManager,
    pub set: &'a WorkingSet,
    pub owners: &'a [usize],
    pub spec: Spec,
    pub seed: u64,
    pub api: Api,
    /// How ours also runs in the bare ping-pong's same-CPU layout (`None`:
    /// it cannot, e.g. against a remote cluster or with an unpinned caller).
    pub same_cpu: Option<SameCpu<'a>>,
}

/// Ours in the bare ping-pong's `same-cpu-blocking` layout: the caller and
/// every local page-server thread on one CPU, the page-servers blocking in
/// their reads (no spin), the caller as configured. The pollers stay where
/// they are: a one-page caller reads its own answers, so they sit idle.
/// Each run there is followed by a return to the bench's own placement.
pub struct SameCpu<'a> {
    cluster: &'a LocalCluster,
    /// The layout's CPU (the bare client's and server's).
    cpu: usize,
    /// The bench's placement, restored after each run: the caller's CPU,
    /// the page-servers' CPUs (empty: not pinned) and their spin.
    caller_cpu: usize,
    server_cpus: Vec<usize>,
    server_spin: Duration,
}

impl<'a> SameCpu<'a> {
    /// The layout for the main-thread caller `caller_cpu` and page-servers
    /// on `server_cpus` spinning `server_spin`, when both the caller and
    /// the layout's CPU are known.
    pub fn new(
        cluster: Option<&'a LocalCluster>,
        caller_cpu: Option<usize>,
        server_cpus: &[usize],
        server_spin: Duration,
    ) -> Option<Self> {
        let (cpu, _) = baseline::Layout::SameCpuBlocking.cpus(&baseline::allowed_cpus())?;
        Some(SameCpu {
            cluster: cluster?,
            cpu,
            caller_cpu: caller_cpu?,
            server_cpus: server_cpus.to_vec(),
            server_spin,
        })
    }

    /// Runs `f` on this thread in the layout, then puts everything back.
    fn run<T>(&self, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        cluster::pin_local_servers(&[self.cpu]);
        self.cluster.set_server_spin(Duration::ZERO);
        let result = baseline::pin_current(self.cpu).and_then(|()| f());
        cluster::pin_local_servers(&self.server_cpus);
        self.cluster.set_server_spin(self.server_spin);
        baseline::pin_current(self.caller_cpu)?;
        result
    }
}

impl Job<'_> {
    /// One run of ours, every page checked (writes by reading every page
    /// back afterwards, as in the main run); an error if any was wrong.
    pub fn run_ours(&self) -> anyhow::Result<workload::Outcome> {
        let mut outcome = workload::run_api(
            self.mgr,
            self.set,
            self.spec,
            self.seed,
            &ProgressBar::hidden(),
            self.api,
        );
        if self.spec.op == Op::Write {
            outcome.bad_pages += self.set.verify_all(self.mgr)?;
            outcome.pages_checked = outcome.ops_done;
        }
        check("ours", outcome.verified())?;
        Ok(outcome)
    }

    /// [`Job::run_ours`] in the bare ping-pong's same-CPU layout; `None`
    /// when the job cannot be placed so.
    pub fn run_ours_same_cpu(&self) -> anyhow::Result<Option<workload::Outcome>> {
        self.same_cpu
            .as_ref()
            .map(|layout| layout.run(|| self.run_ours()))
            .transpose()
    }
}

/// An error naming `what` unless its run checked every page and found
/// each right.
pub fn check(what: &str, verified: bool) -> anyhow::Result<()> {
    if verified {
        Ok(())
    } else {
        anyhow::bail!("{what}: not every page checked and right")
    }
}
