//! Where the bare ping-pong's two threads run and how they wait: the
//! layouts a program on this machine may get, the library included.

use anyhow::bail;

/// One placement of the baseline's client and server threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Client and server pinned to the same CPU, blocking reads: every
    /// answer is a wake-up on the CPU that just went to sleep.
    SameCpuBlocking,
    /// Client and server pinned to different CPUs, blocking reads: every
    /// answer wakes a (possibly idle) other CPU. The slowest layout on a VM.
    CrossCpuBlocking,
    /// Client and server pinned to different CPUs, non-blocking sockets
    /// read in a spin loop: no wake-ups at all, at the cost of two busy CPUs.
    CrossCpuSpinning,
}

impl Layout {
    /// Every layout, in the order they run.
    pub const ALL: [Layout; 3] = [
        Layout::SameCpuBlocking,
        Layout::CrossCpuSpinning,
        Layout::CrossCpuBlocking,
    ];

    /// The name printed and written to JSON.
    pub fn name(self) -> &'static str {
        match self {
            Layout::SameCpuBlocking => "same-cpu-blocking",
            Layout::CrossCpuBlocking => "cross-cpu-blocking",
            Layout::CrossCpuSpinning => "cross-cpu-spinning",
        }
    }

    /// True when both threads spin on non-blocking sockets.
    pub fn spinning(self) -> bool {
        self == Layout::CrossCpuSpinning
    }

    /// The CPU ids of (client, server), from the CPUs this process may use:
    /// the first one for the client (where the bench's faulting thread and
    /// handler run too), and for the cross-CPU layouts the last one for the
    /// server (where the library's poller runs). `None` when the layout
    /// needs two CPUs and the process has one.
    pub fn cpus(self, allowed: &[usize]) -> Option<(usize, usize)> {
        let (&first, &last) = (allowed.first()?, allowed.last()?);
        match self {
            Layout::SameCpuBlocking => Some((first, first)),
            Layout::CrossCpuBlocking | Layout::CrossCpuSpinning => {
                (first != last).then_some((first, last))
            }
        }
    }
}

impl Layout {
    /// The CPUs of `servers` server threads in `placement` (from
    /// [`Layout::cpus`]): all on the server CPU when they block; when they
    /// spin, each on a CPU of its own from the last one down, none the
    /// client's (spinners sharing a CPU wait a time slice for each other).
    /// `None` when there are not enough CPUs for that.
    pub fn server_cpus(
        self,
        allowed: &[usize],
        (client, server): (usize, usize),
        servers: usize,
    ) -> Option<Vec<usize>> {
        if !self.spinning() {
            return Some(vec![server; servers]);
        }
        let own: Vec<usize> = allowed
            .iter()
            .rev()
            .copied()
            .filter(|&c| c != client)
            .take(servers)
            .collect();
        (own.len() == servers).then_some(own)
    }
}

/// The CPU ids this process may run on, in ascending order: the calling
/// thread's affinity at the first call, kept. (The bench pins its main
/// thread to the caller's CPU, `pin_first_free`; the layouts must still see
/// every CPU. `main` calls this before any pinning.)
pub fn allowed_cpus() -> Vec<usize> {
    static ALLOWED: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    ALLOWED
        .get_or_init(|| {
            let mut ids: Vec<usize> = core_affinity::get_core_ids()
                .unwrap_or_default()
                .into_iter()
                .map(|c| c.id)
                .collect();
            ids.sort_unstable();
            ids
        })
        .clone()
}

/// Pins the calling thread, and so the threads it starts, to the first CPU
/// this process may use that is not in `avoid`. `None` when every CPU is in
/// `avoid`: then it is not pinned.
pub fn pin_first_free(avoid: &[usize]) -> anyhow::Result<Option<usize>> {
    let Some(cpu) = allowed_cpus().into_iter().find(|c| !avoid.contains(c)) else {
        return Ok(None);
    };
    pin_current(cpu)?;
    Ok(Some(cpu))
}

/// Pins the calling thread to `cpu`; a layout that cannot be had is an error,
/// not a silently different measurement.
pub fn pin_current(cpu: usize) -> anyhow::Result<()> {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        bail!("cannot pin a baseline thread to CPU {cpu}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_per_layout() {
        assert_eq!(Layout::SameCpuBlocking.cpus(&[0, 1]), Some((0, 0)));
        assert_eq!(Layout::CrossCpuSpinning.cpus(&[0, 1, 2, 3]), Some((0, 3)));
        assert_eq!(Layout::CrossCpuBlocking.cpus(&[2]), None, "one CPU");
        assert_eq!(Layout::SameCpuBlocking.cpus(&[]), None);
    }

    #[test]
    fn spinning_servers_get_a_cpu_each() {
        let two = [0, 1];
        let spin = Layout::CrossCpuSpinning;
        assert_eq!(spin.server_cpus(&two, (0, 1), 1), Some(vec![1]));
        assert_eq!(spin.server_cpus(&two, (0, 1), 2), None);
        assert_eq!(spin.server_cpus(&[0, 1, 2], (0, 2), 2), Some(vec![2, 1]));
        let block = Layout::SameCpuBlocking;
        assert_eq!(block.server_cpus(&two, (0, 0), 2), Some(vec![0, 0]));
    }

    #[test]
    fn pin_first_free_skips_the_avoided_cpus() {
        let all = allowed_cpus();
        std::thread::spawn(move || {
            assert_eq!(pin_first_free(&all).expect("nothing to pin"), None);
            let skip = &all[..all.len() - 1];
            let cpu = pin_first_free(skip).expect("pins").expect("a CPU is left");
            assert_eq!(cpu, *all.last().expect("a CPU"));
            let now: Vec<usize> = core_affinity::get_core_ids()
                .unwrap_or_default()
                .into_iter()
                .map(|c| c.id)
                .collect();
            assert_eq!(now, vec![cpu], "the thread runs on that CPU only");
            // The process's CPUs are still every CPU for the layouts.
            assert_eq!(allowed_cpus(), all);
        })
        .join()
        .expect("pinning thread");
    }

    #[test]
    fn names_are_distinct() {
        let mut names: Vec<_> = Layout::ALL.iter().map(|l| l.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Layout::ALL.len());
    }
}
