//! A coherent node's embedder for tests: `Copies` holds its local copies as
//! `GuestMemory` does in guest RAM, `Node` is one hypervisor node (its
//! manager, its `CoherentNode`, its copies) with the vCPU's view: read a
//! page once it holds a copy, change it while it owns it.

use std::collections::HashMap;
use std::sync::Arc;

use page_server::RunningServer;
use parking_lot::Mutex;
use rdma_transport::auth::ClusterKey;
use rdma_transport::coherent::{
    Access, CoherenceConfig, CoherenceHandler, CoherentNode, Mode, Recall, RecallAnswer,
};
use rdma_transport::coordinator::api::{MapEntry, MapResponse, NodeInfo, RangeState};
use rdma_transport::{Page, TransportError, TransportManager};

/// A manager of the one range at `gpa_base` that `server` (node `home`)
/// exports, over TCP with `key`, on a fixed map (no coordinator).
pub fn home_manager(
    server: &RunningServer,
    home: &str,
    gpa_base: u64,
    key: &ClusterKey,
) -> TransportManager {
    let map = MapResponse {
        version: 1,
        generation: 0,
        entries: vec![MapEntry {
            gpa_start: gpa_base,
            length_bytes: super::NODE_BYTES as u64,
            node_id: home.into(),
            remote_offset: 0,
            rdma: None,
            valid_epoch: 0,
            state: RangeState::Live,
            replicas: Vec::new(),
        }],
        nodes: vec![NodeInfo {
            id: home.into(),
            tcp_addr: server.addr().to_string(),
            rdma: None,
            alive: true,
            last_seen_ms_ago: 0,
            epoch: 0,
        }],
    };
    super::fixed_map_manager(map, Some(key))
}

/// A node's local copies: what `GuestMemory` will keep in guest RAM.
#[derive(Debug, Default)]
pub struct Copies {
    pub pages: Mutex<HashMap<u64, (Mode, Box<Page>)>>,
    pub recalls: Mutex<Vec<(u64, Recall)>>,
}

impl CoherenceHandler for Copies {
    fn install(&self, gpa: u64, mode: Mode, data: Option<&Page>) {
        let mut pages = self.pages.lock();
        match (data, pages.get_mut(&gpa)) {
            (Some(data), _) => {
                pages.insert(gpa, (mode, Box::new(*data)));
            }
            (None, Some(entry)) => entry.0 = mode,
            (None, None) => panic!("an upgrade of {gpa:#x} without a copy"),
        }
    }

    fn recall(&self, gpa: u64, recall: Recall) -> RecallAnswer {
        self.recalls.lock().push((gpa, recall));
        let mut pages = self.pages.lock();
        let answer = match (recall.needs_data(), pages.get(&gpa)) {
            (true, Some((_, data))) => RecallAnswer::WriteBack(data.clone()),
            _ => RecallAnswer::Done,
        };
        match recall {
            Recall::Invalidate { .. } => {
                pages.remove(&gpa);
            }
            Recall::Downgrade => {
                if let Some(entry) = pages.get_mut(&gpa) {
                    entry.0 = Mode::Shared;
                }
            }
        }
        answer
    }
}

impl Copies {
    pub fn copy(&self, gpa: u64) -> Option<(Mode, Page)> {
        self.pages.lock().get(&gpa).map(|(m, p)| (*m, **p))
    }

    pub fn take_recalls(&self) -> Vec<(u64, Recall)> {
        std::mem::take(&mut *self.recalls.lock())
    }
}

/// One hypervisor node: its manager, its coherent side and its copies.
pub struct Node {
    pub copies: Arc<Copies>,
    pub coherent: Option<CoherentNode>,
    pub manager: TransportManager,
}

impl Node {
    /// A node on `manager`, whose map says where the homes are.
    pub fn with_manager(manager: TransportManager, min_hold_us: u64) -> Self {
        let config = CoherenceConfig {
            min_hold_us,
            timeout_ms: 5_000,
            ..CoherenceConfig::default()
        };
        Self::with_config(manager, config)
    }

    /// A node on `manager` with `config`.
    pub fn with_config(manager: TransportManager, config: CoherenceConfig) -> Self {
        let copies = Arc::new(Copies::default());
        let coherent =
            manager.coherent_node(Arc::clone(&copies) as Arc<dyn CoherenceHandler>, config);
        Self {
            copies,
            coherent: Some(coherent),
            manager,
        }
    }

    pub fn c(&self) -> &CoherentNode {
        self.coherent.as_ref().expect("node alive")
    }

    /// Reads the page as a vCPU would: its copy once it holds one.
    pub fn read(&self, gpa: u64) -> Result<Page, TransportError> {
        for _ in 0..1000 {
            self.c().acquire(gpa, Access::Read)?;
            if let Some((_, page)) = self.copies.copy(gpa) {
                return Ok(page);
            }
        }
        panic!("no copy of {gpa:#x} after 1000 grants");
    }

    /// Changes the page as a vCPU would: in its copy, while it owns it.
    pub fn modify(&self, gpa: u64, f: impl Fn(&mut Page)) -> Result<(), TransportError> {
        for _ in 0..1000 {
            self.c().acquire(gpa, Access::Write)?;
            let mut pages = self.copies.pages.lock();
            if let Some((Mode::Exclusive, page)) = pages.get_mut(&gpa) {
                f(page);
                return Ok(());
            }
        }
        panic!("no ownership of {gpa:#x} after 1000 grants");
    }

    /// Dies: its connections close without writing anything back.
    pub fn kill(&mut self) {
        self.coherent = None;
    }
}
