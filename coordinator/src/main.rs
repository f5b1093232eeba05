//! `coordinator` binary: serves the coordinator API until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use coordinator::{CoordinatorConfig, EtcdConfig, Limits, Server, StoreConfig};
use rdma_transport::auth::{key_from_flags, ClusterKey};
use tracing_subscriber::EnvFilter;

/// Stores node endpoints and the GPA ownership map of the remote-memory
/// paging transport, in SQLite or in an etcd cluster.
#[derive(Debug, Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prints a credential derived from the cluster key, for
    /// `Authorization: Bearer <credential>` (e.g. with curl).
    Credential(CredentialArgs),
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("kind").required(true).args(["admin", "client", "node"])))]
struct CredentialArgs {
    /// The cluster key file.
    #[arg(long, env = "RT_CLUSTER_KEY_FILE")]
    cluster_key_file: PathBuf,
    /// The admin credential: every route.
    #[arg(long)]
    admin: bool,
    /// The client credential: reads only.
    #[arg(long)]
    client: bool,
    /// The credential of this node (printed as `node:<id>:<hex>`).
    #[arg(long, value_name = "ID")]
    node: Option<String>,
}

/// The backends `--store` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StoreKind {
    Sqlite,
    Etcd,
}

/// Serving (no subcommand).
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Where the state lives: `sqlite` (the --db file; one coordinator)
    /// or `etcd` (the --etcd-endpoints cluster; run several coordinators).
    #[arg(long, value_enum, default_value_t = StoreKind::Sqlite)]
    store: StoreKind,
    /// SQLite database file (created when missing), with --store sqlite.
    #[arg(long, default_value = "coordinator.db")]
    db: PathBuf,
    /// Client URLs of the etcd members, comma-separated, with --store etcd
    /// (e.g. http://10.0.0.1:2379,http://10.0.0.2:2379,http://10.0.0.3:2379).
    #[arg(long, value_delimiter = ',', required_if_eq("store", "etcd"))]
    etcd_endpoints: Vec<String>,
    /// Prefix of every etcd key this coordinator uses; coordinators of one
    /// cluster share it.
    #[arg(long, default_value = EtcdConfig::DEFAULT_PREFIX)]
    etcd_prefix: String,
    /// An etcd request fails (the HTTP request answers 503) after this long.
    #[arg(long, default_value_t = EtcdConfig::DEFAULT_REQUEST_TIMEOUT_MS)]
    etcd_timeout_ms: u64,
    /// Hex cluster key file (mode 600): every route but /v1/health then
    /// needs a credential derived from it (`coordinator credential --help`).
    #[arg(long, env = "RT_CLUSTER_KEY_FILE")]
    cluster_key_file: Option<PathBuf>,
    /// Run without a cluster key: anyone who can reach the coordinator
    /// reads every node address and, without --token, can re-register any
    /// node and take its traffic.
    #[arg(long)]
    insecure: bool,
    /// An extra admin credential (`Authorization: Bearer <token>`); without
    /// a cluster key it guards writes only. Defaults to the environment
    /// variable COORDINATOR_TOKEN, which keeps it out of `ps`.
    #[arg(long)]
    token: Option<String>,
    /// A node is alive while its last heartbeat is younger than this.
    #[arg(long, default_value_t = CoordinatorConfig::DEFAULT_LEASE_MS)]
    lease_ms: u64,
    /// Once listening, write the bound address (e.g. 127.0.0.1:40123) to
    /// this file.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Registered nodes at most.
    #[arg(long, default_value_t = Limits::default().max_nodes)]
    max_nodes: usize,
    /// Map entries at most.
    #[arg(long, default_value_t = Limits::default().max_ranges)]
    max_ranges: usize,
    /// Replicas one node may hold at most (its ranges).
    #[arg(long, default_value_t = Limits::default().max_ranges_per_node)]
    max_ranges_per_node: usize,
    /// Replicas (holders) of one range at most.
    #[arg(long, default_value_t = Limits::default().max_replicas)]
    max_replicas: usize,
    /// Connections served at once.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// A connection must send a whole request head within this long.
    #[arg(long, default_value_t = Limits::default().header_timeout_ms)]
    header_timeout_ms: u64,
    /// A request body must arrive within this long after its head.
    #[arg(long, default_value_t = Limits::default().body_timeout_ms)]
    body_timeout_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let Args {
        command,
        serve: args,
    } = Args::parse();
    if let Some(Command::Credential(credential)) = command {
        return print_credential(&credential);
    }
    let cluster_key = key_from_flags(args.cluster_key_file.as_deref(), args.insecure)
        .map_err(anyhow::Error::msg)?;
    let token = args
        .token
        .or_else(|| std::env::var("COORDINATOR_TOKEN").ok())
        .filter(|token| !token.is_empty());
    let store = match args.store {
        StoreKind::Sqlite => StoreConfig::Sqlite,
        StoreKind::Etcd => StoreConfig::Etcd(EtcdConfig {
            endpoints: args.etcd_endpoints,
            prefix: args.etcd_prefix,
            request_timeout_ms: args.etcd_timeout_ms,
        }),
    };
    let config = CoordinatorConfig {
        listen: args.listen,
        db_path: args.db,
        store,
        cluster_key,
        token,
        lease_ms: args.lease_ms,
        limits: Limits {
            max_nodes: args.max_nodes,
            max_ranges: args.max_ranges,
            max_ranges_per_node: args.max_ranges_per_node,
            max_replicas: args.max_replicas,
            max_connections: args.max_connections,
            header_timeout_ms: args.header_timeout_ms,
            body_timeout_ms: args.body_timeout_ms,
        },
    };
    let server = Server::bind(config).await?;
    if let Some(path) = &args.ready_file {
        write_ready_file(path, server.local_addr())
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }
    server.serve(shutdown_signal()).await?;
    Ok(())
}

/// `coordinator credential`: prints the asked-for credential on stdout.
fn print_credential(args: &CredentialArgs) -> anyhow::Result<()> {
    let key = ClusterKey::from_file(&args.cluster_key_file)?;
    let credential = match &args.node {
        Some(id) => {
            anyhow::ensure!(
                rdma_transport::coordinator::api::is_valid_node_id(id),
                "invalid node id {id:?}: use 1 to 64 characters of [A-Za-z0-9_.-]"
            );
            format!("node:{id}:{}", key.node_credential(id))
        }
        None if args.admin => key.admin_credential(),
        None => key.client_credential(),
    };
    println!("{credential}");
    Ok(())
}

/// Writes `addr` to `path` atomically (temporary file, then rename), so a
/// reader never sees a partial address.
fn write_ready_file(path: &Path, addr: SocketAddr) -> std::io::Result<()> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    std::fs::write(&temporary, addr.to_string())?;
    std::fs::rename(&temporary, path)
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot wait for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot wait for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = interrupt => tracing::info!("SIGINT received"),
        () = terminate => tracing::info!("SIGTERM received"),
    }
}
