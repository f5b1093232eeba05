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

/// The CPU ids this process may run on, in ascending order.
pub fn allowed_cpus() -> Vec<usize> {
    let mut ids: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    ids.sort_unstable();
    ids
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
    fn names_are_distinct() {
        let mut names: Vec<_> = Layout::ALL.iter().map(|l| l.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Layout::ALL.len());
    }
}
