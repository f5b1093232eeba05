//! What the rounds modes share: the job whose runs of ours
//! `--latency-rounds` and `--throughput-rounds` repeat, and the check
//! (theirs and `--fault-rounds`') that a run moved only right pages.

use indicatif::ProgressBar;
use rdma_transport::TransportManager;

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
