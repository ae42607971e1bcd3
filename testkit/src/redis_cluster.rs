//! A throwaway Redis Cluster: three masters and three replicas on loopback, with the faults a cluster
//! meets in production (a manual failover, a master killed, a slot migrated) at the test's command.

use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::Connection;
use tempfile::TempDir;

use super::{TestkitError, free_port, io, run};

/// How long a node may be silent before the others count it as failed (and a replica takes over).
const NODE_TIMEOUT_MS: u64 = 2_000;

/// A six-node Redis Cluster (three masters, one replica each) of `redis-server` children without
/// persistence. Its controls take `&self` and block (call them from `spawn_blocking` in async tests).
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Node>,
    dir: TempDir,
}

#[derive(Debug)]
struct Node {
    port: u16,
    bus_port: u16,
    child: Mutex<Option<Child>>,
}

/// One line of `CLUSTER NODES`, as the cluster sees a node.
#[derive(Clone, Debug)]
struct NodeLine {
    id: String,
    port: u16,
    master: bool,
    /// Slot ranges served, for a master.
    slots: Vec<(u16, u16)>,
}

/// A little longer than Redis's own limit on a manual failover (`CLUSTER_MF_TIMEOUT`, 5 s), after which
/// it gives the failover up.
const MANUAL_FAILOVER_TIMEOUT: Duration = Duration::from_secs(6);

impl RedisCluster {
    /// Starts six nodes, joins them into a cluster and waits until every node reports
    /// `cluster_state:ok`.
    ///
    /// # Errors
    /// [`TestkitError`] if `redis-server` or `redis-cli` is missing or the cluster does not form.
    pub fn start() -> Result<Self, TestkitError> {
        super::ensure_installed("redis-server", "redis-server")?;
        super::ensure_installed("redis-cli", "redis-tools")?;
        let dir = super::scratch_dir("idemstore-redis-cluster-", "creating a Redis Cluster directory")?;
        let mut cluster = Self { nodes: Vec::new(), dir };
        for _ in 0..6 {
            let node = cluster.spawn_new_node()?;
            cluster.nodes.push(node);
        }
        let addresses: Vec<String> = cluster.nodes.iter().map(|node| format!("127.0.0.1:{}", node.port)).collect();
        run(
            "redis-cli --cluster create",
            Command::new("redis-cli").args(["--cluster", "create"]).args(&addresses).args([
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ]),
        )?;
        cluster.wait_until_ok()?;
        cluster.wait_for_replicas()?;
        Ok(cluster)
    }

    /// `redis://127.0.0.1:<port>/` of every node, for a client's seed list.
    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes.iter().map(|node| url(node.port)).collect()
    }

    /// The ports of the nodes that are masters now, as the cluster sees them, in slot order.
    ///
    /// # Errors
    /// [`TestkitError`] if no node answers.
    pub fn master_ports(&self) -> Result<Vec<u16>, TestkitError> {
        let mut masters: Vec<NodeLine> =
            self.topology()?.into_iter().filter(|n| n.master && !n.slots.is_empty()).collect();
        masters.sort_by_key(|n| n.slots.first().map_or(0, |range| range.0));
        Ok(masters.into_iter().map(|n| n.port).collect())
    }

    /// The port of the master serving `slot`.
    ///
    /// # Errors
    /// [`TestkitError`] if no node answers or no master serves the slot.
    pub fn master_of_slot(&self, slot: u16) -> Result<u16, TestkitError> {
        Ok(self.owner(&self.topology()?, slot)?.port)
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    ///
    /// # Errors
    /// [`TestkitError`] if no node answers.
    pub fn slot_of(&self, key: &str) -> Result<u16, TestkitError> {
        let mut last = None;
        for node in &self.nodes {
            match query(node.port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)) {
                Ok(slot) => return Ok(slot),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| failed("finding a key's slot", "no node".into())))
    }

    /// The number of keys a node holds (`DBSIZE`).
    ///
    /// # Errors
    /// [`TestkitError`] if the node does not answer.
    pub fn key_count(&self, port: u16) -> Result<u64, TestkitError> {
        query(port, &redis::cmd("DBSIZE"))
    }

    /// Drops every node's script cache (`SCRIPT FLUSH`), as a restart of each would.
    ///
    /// # Errors
    /// [`TestkitError`] if a node does not answer.
    pub fn flush_scripts(&self) -> Result<(), TestkitError> {
        for node in &self.nodes {
            query::<()>(node.port, redis::cmd("SCRIPT").arg("FLUSH"))?;
        }
        Ok(())
    }

    /// A manual failover of `master_port`: one of its replicas takes over in agreement with it (no write
    /// is lost). Returns once the replica reports itself master and the cluster is ok again; returns the
    /// new master's port.
    ///
    /// # Errors
    /// [`TestkitError`] if the master has no replica or the switch does not happen within 30 s.
    pub fn failover(&self, master_port: u16) -> Result<u16, TestkitError> {
        // Each replica's own word (ROLE), not another node's gossip, which may lag.
        let replica = self
            .live_ports(Some(master_port))
            .into_iter()
            .find(|port| replicated_master(*port).is_ok_and(|master| master == Some(master_port)))
            .ok_or_else(|| failed("failing over", format!("master {master_port} has no replica")))?;
        // OK comes before the switch: wait for the replica to say it is master. A coordinated failover
        // that does not finish within Redis's manual-failover timeout (5 s: the replica did not catch up
        // with its paused master, as on a busy machine) is dropped without a word: ask again.
        query::<()>(replica, redis::cmd("CLUSTER").arg("FAILOVER"))?;
        let mut asked = Instant::now();
        self.wait_for("the replica to take over", || {
            if role(replica)? == "master" {
                return Ok(true);
            }
            if asked.elapsed() > MANUAL_FAILOVER_TIMEOUT {
                query::<()>(replica, redis::cmd("CLUSTER").arg("FAILOVER"))?;
                asked = Instant::now();
            }
            Ok(false)
        })?;
        self.wait_until_ok()?;
        self.wait_for("every node to see the new master", || {
            Ok(self.live_ports(None).into_iter().all(|port| {
                topology_of(port)
                    .is_ok_and(|seen| seen.iter().any(|n| n.port == replica && n.master && !n.slots.is_empty()))
            }))
        })?;
        Ok(replica)
    }

    /// SIGKILLs the node on `port`: everything it held is gone. A killed master's replica takes over
    /// after the node timeout (2 s); meanwhile its slots answer CLUSTERDOWN.
    pub fn kill(&self, port: u16) {
        if let Some(node) = self.nodes.iter().find(|n| n.port == port) {
            stop(&node.child);
        }
    }

    /// Waits until the killed master `port`'s slots are served by one of its replicas (three masters
    /// serve every slot again, none of them on `port`) and the surviving nodes report
    /// `cluster_state:ok`.
    ///
    /// # Errors
    /// [`TestkitError`] if no replica took over within 30 s.
    pub fn wait_for_takeover_of(&self, port: u16) -> Result<(), TestkitError> {
        self.wait_for("a replica to take over the killed master", || {
            let topology = self.topology_from_live_nodes(port)?;
            let masters: Vec<&NodeLine> = topology.iter().filter(|n| n.master && !n.slots.is_empty()).collect();
            let served: usize =
                masters.iter().flat_map(|n| &n.slots).map(|(from, to)| usize::from(to - from) + 1).sum();
            Ok(masters.iter().all(|n| n.port != port) && served == 16_384)
        })?;
        self.wait_until_ok_except(Some(port))
    }

    /// Starts a killed node again on its port, with its cluster configuration file: it rejoins as a
    /// replica of the node that took over its slots. Restart a master only after its takeover, or it
    /// comes back empty and its replicas follow it.
    ///
    /// # Errors
    /// [`TestkitError`] if the node does not come up.
    pub fn restart(&self, port: u16) -> Result<(), TestkitError> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .ok_or_else(|| failed("restarting a node", format!("no node on port {port}")))?;
        stop(&node.child);
        *lock(&node.child) = Some(self.spawn(node.port, node.bus_port)?);
        self.wait_until_ok()?;
        self.wait_for_replicas()
    }

    /// Moves `slot` to the master on `to_port` the way `redis-cli --cluster reshard` does: the target
    /// imports, the source migrates, keys are moved one by one with `pause` after each (requests for
    /// moved keys meanwhile get ASK), then every master is told the new owner (requests then get MOVED
    /// until a client refreshes its map).
    ///
    /// # Errors
    /// [`TestkitError`] if a step is refused.
    pub fn migrate_slot(&self, slot: u16, to_port: u16, pause: Duration) -> Result<(), TestkitError> {
        let topology = self.topology()?;
        let source = self.owner(&topology, slot)?.clone();
        let target = find(&topology, to_port)?.clone();
        if source.port == target.port {
            return Ok(());
        }
        let setslot = |port: u16, state: &str, id: &str| {
            query::<()>(port, redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg(state).arg(id))
        };
        setslot(target.port, "IMPORTING", &source.id)?;
        setslot(source.port, "MIGRATING", &target.id)?;
        loop {
            let keys: Vec<String> = query(source.port, redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(1))?;
            let Some(key) = keys.first() else { break };
            let mut migrate = redis::cmd("MIGRATE");
            migrate.arg("127.0.0.1").arg(target.port).arg("").arg(0).arg(5_000).arg("REPLACE").arg("KEYS").arg(key);
            query::<()>(source.port, &migrate)?;
            std::thread::sleep(pause);
        }
        for master in self.topology()?.iter().filter(|n| n.master) {
            setslot(master.port, "NODE", &target.id)?;
        }
        self.wait_until_ok()
    }

    fn topology(&self) -> Result<Vec<NodeLine>, TestkitError> {
        self.topology_from_live_nodes(0)
    }

    /// `CLUSTER NODES` as seen by the first node that answers, other than `except`, without the
    /// nodes it flags as failed.
    fn topology_from_live_nodes(&self, except: u16) -> Result<Vec<NodeLine>, TestkitError> {
        let mut last = None;
        for node in self.nodes.iter().filter(|n| n.port != except) {
            match topology_of(node.port) {
                Ok(topology) => return Ok(topology),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| failed("reading the topology", "no node".into())))
    }

    fn owner<'a>(&self, topology: &'a [NodeLine], slot: u16) -> Result<&'a NodeLine, TestkitError> {
        topology
            .iter()
            .find(|n| n.master && n.slots.iter().any(|(from, to)| (*from..=*to).contains(&slot)))
            .ok_or_else(|| failed("finding a slot's master", format!("no master serves slot {slot}")))
    }

    fn wait_until_ok(&self) -> Result<(), TestkitError> {
        self.wait_until_ok_except(None)
    }

    fn wait_until_ok_except(&self, except: Option<u16>) -> Result<(), TestkitError> {
        let live = self.live_ports(except);
        self.wait_for("cluster_state:ok on every node", || {
            Ok(live.iter().all(|port| {
                query::<String>(*port, redis::cmd("CLUSTER").arg("INFO"))
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            }))
        })
    }

    /// Waits until every replica finished its sync: a replica that never synced has data "too old" and
    /// never takes over from its master.
    fn wait_for_replicas(&self) -> Result<(), TestkitError> {
        self.wait_for("every replica to sync", || {
            Ok(self.live_ports(None).into_iter().all(|port| {
                query::<String>(port, redis::cmd("INFO").arg("replication"))
                    .is_ok_and(|info| info.contains("role:master") || info.contains("master_link_status:up"))
            }))
        })
    }

    /// The ports of the nodes this cluster runs, but `except`.
    fn live_ports(&self, except: Option<u16>) -> Vec<u16> {
        self.nodes.iter().filter(|n| Some(n.port) != except && lock(&n.child).is_some()).map(|n| n.port).collect()
    }

    fn wait_for(
        &self,
        what: &'static str,
        mut done: impl FnMut() -> Result<bool, TestkitError>,
    ) -> Result<(), TestkitError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if done().unwrap_or(false) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(failed(what, "not within 30 s".into()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A new node on free ports (a bus port of its own: the default, port + 10000, is past 65535 for
    /// high free ports).
    fn spawn_new_node(&self) -> Result<Node, TestkitError> {
        let mut attempts = 0;
        loop {
            let (port, bus_port) = (free_port()?, free_port()?);
            match self.spawn(port, bus_port) {
                Ok(child) => return Ok(Node { port, bus_port, child: Mutex::new(Some(child)) }),
                Err(_) if attempts < 4 => attempts += 1,
                Err(error) => return Err(error),
            }
        }
    }

    fn spawn(&self, port: u16, bus_port: u16) -> Result<Child, TestkitError> {
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--cluster-port", &bus_port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--cluster-enabled", "yes"])
            .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
            .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
            // Replicas sync at once instead of after the default 5 s.
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io("starting redis-server"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        // The answer must come from this child: another process may hold the port (this child then
        // exits, unable to bind).
        let own = format!("process_id:{}\r\n", child.id());
        while !query::<String>(port, redis::cmd("INFO").arg("server")).is_ok_and(|info| info.contains(&own)) {
            if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed("waiting for a cluster node", format!("no PONG on port {port} within 10 s")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(child)
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &self.nodes {
            stop(&node.child);
        }
    }
}

fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}

fn lock(child: &Mutex<Option<Child>>) -> std::sync::MutexGuard<'_, Option<Child>> {
    child.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn stop(child: &Mutex<Option<Child>>) {
    if let Some(mut child) = lock(child).take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn failed(step: &'static str, output: String) -> TestkitError {
    TestkitError::Failed { step, output }
}

fn connect(port: u16) -> Result<Connection, TestkitError> {
    let client = redis::Client::open(url(port)).map_err(|e| failed("connecting to a cluster node", e.to_string()))?;
    client
        .get_connection_with_timeout(Duration::from_secs(2))
        .map_err(|e| failed("connecting to a cluster node", e.to_string()))
}

fn query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Result<T, TestkitError> {
    let mut conn = connect(port)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| failed("configuring a connection", e.to_string()))?;
    cmd.query(&mut conn).map_err(|e| failed("a cluster command", format!("port {port}: {e}")))
}

fn role(port: u16) -> Result<String, TestkitError> {
    let reply: Vec<redis::Value> = query(port, &redis::cmd("ROLE"))?;
    match reply.first() {
        Some(redis::Value::BulkString(role)) => Ok(String::from_utf8_lossy(role).into_owned()),
        _ => Err(failed("reading ROLE", format!("port {port}: unexpected reply"))),
    }
}

/// The port of the master the node on `port` replicates, from its `ROLE`; `None` for a master.
fn replicated_master(port: u16) -> Result<Option<u16>, TestkitError> {
    let reply: Vec<redis::Value> = query(port, &redis::cmd("ROLE"))?;
    Ok(match reply.as_slice() {
        [redis::Value::BulkString(role), _, redis::Value::Int(master), ..] if role == b"slave" => {
            u16::try_from(*master).ok()
        }
        _ => None,
    })
}

fn find(topology: &[NodeLine], port: u16) -> Result<&NodeLine, TestkitError> {
    topology.iter().find(|n| n.port == port).ok_or_else(|| failed("finding a node", format!("no node on {port}")))
}

/// Parses `CLUSTER NODES` of the node on `port`, leaving out nodes flagged failed.
fn topology_of(port: u16) -> Result<Vec<NodeLine>, TestkitError> {
    let text: String = query(port, redis::cmd("CLUSTER").arg("NODES"))?;
    Ok(text.lines().filter_map(parse_node_line).collect())
}

fn parse_node_line(line: &str) -> Option<NodeLine> {
    let fields: Vec<&str> = line.split(' ').collect();
    let (id, address, flags) = (fields.first()?, fields.get(1)?, fields.get(2)?);
    if flags.contains("fail") && !flags.contains("fail?") {
        return None;
    }
    let port = address.split(['@', ',']).next()?.rsplit(':').next()?.parse().ok()?;
    let slots = fields
        .iter()
        .skip(8)
        .filter(|range| !range.starts_with('['))
        .filter_map(|range| match range.split_once('-') {
            Some((from, to)) => Some((from.parse().ok()?, to.parse().ok()?)),
            None => range.parse().ok().map(|slot| (slot, slot)),
        })
        .collect();
    Some(NodeLine { id: (*id).to_owned(), port, master: flags.contains("master"), slots })
}
