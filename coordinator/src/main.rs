//! `coordinator` binary: serves the coordinator API until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Parser;
use coordinator::{CoordinatorConfig, Server};
use tracing_subscriber::EnvFilter;

/// Stores node endpoints and the GPA ownership map of the remote-memory
/// paging transport, in SQLite.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// SQLite database file (created when missing).
    #[arg(long, default_value = "coordinator.db")]
    db: PathBuf,
    /// Bearer token every write must carry. Defaults to the environment
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let token = args
        .token
        .or_else(|| std::env::var("COORDINATOR_TOKEN").ok())
        .filter(|token| !token.is_empty());
    let config = CoordinatorConfig {
        listen: args.listen,
        db_path: args.db,
        token,
        lease_ms: args.lease_ms,
    };
    let server = Server::bind(config).await?;
    if let Some(path) = &args.ready_file {
        write_ready_file(path, server.local_addr())
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }
    server.serve(shutdown_signal()).await?;
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
