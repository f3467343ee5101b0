//! Linux network namespaces for fault tests: a hub namespace holding a bridge, one namespace
//! per node (a pd process, or the test's client) joined to the bridge by a veth pair, with
//! addresses 10.201.S.x/24 that exist only inside these namespaces. A node's link can be set
//! down and up (a partition) or rate-limited with `tbf`; a thread can enter a node's namespace (its sockets then live
//! there). Everything is removed when the `Net` is dropped. Needs root and iproute2; `create`
//! says why when it cannot.

use std::path::Path;
use std::process::Command;

/// A bridge and its nodes.
#[derive(Debug)]
pub struct Net {
    prefix: String,
    subnet: u8,
    nodes: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Net {
    /// Creates the hub and one namespace per node (names of at most 6 characters).
    pub fn create(nodes: &[&str]) -> Result<Net, String> {
        let pid = std::process::id();
        let net = Net {
            prefix: format!("pd{}", pid % 100_000),
            subnet: (pid % 200) as u8 + 20,
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
        };
        let hub = net.hub();
        ip(&["netns", "add", &hub])?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for (i, node) in nodes.iter().enumerate() {
            let ns = net.ns(node);
            ip(&["netns", "add", &ns])?;
            let veth = format!("v{i}");
            ip(&["-n", &hub, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
            ip(&["-n", &hub, "link", "set", &veth, "master", "br0", "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", net.addr(node)), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    fn hub(&self) -> String {
        format!("{}-hub", self.prefix)
    }

    fn index(&self, node: &str) -> usize {
        self.nodes.iter().position(|n| n == node).unwrap_or_else(|| panic!("no node {node}"))
    }

    /// The namespace of `node`.
    pub fn ns(&self, node: &str) -> String {
        format!("{}-{node}", self.prefix)
    }

    /// The IPv4 address of `node`.
    pub fn addr(&self, node: &str) -> String {
        format!("10.201.{}.{}", self.subnet, self.index(node) + 2)
    }

    /// Sets `node`'s link to the bridge down (a partition) or up.
    pub fn link(&self, node: &str, up: bool) {
        let veth = format!("v{}", self.index(node));
        ip(&["-n", &self.hub(), "link", "set", &veth, if up { "up" } else { "down" }]).expect("link state");
    }

    /// Limits traffic toward `node` to `rate` (a tc rate such as "2mbit") with a token bucket
    /// on the bridge's side of its link, or lifts the limit (`None`).
    pub fn throttle(&self, node: &str, rate: Option<&str>) {
        let veth = format!("v{}", self.index(node));
        let hub = self.hub();
        let mut args = vec!["netns", "exec", &hub, "tc", "qdisc"];
        match rate {
            Some(rate) => {
                args.extend(["replace", "dev", &veth, "root", "tbf", "rate", rate, "burst", "16kb", "latency", "400ms"])
            }
            None => args.extend(["del", "dev", &veth, "root"]),
        }
        let out = Command::new("ip").args(&args).output().expect("running ip netns exec tc");
        assert!(out.status.success(), "{}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }

    /// A command that runs `program` inside `node`'s namespace.
    pub fn command(&self, node: &str, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(node)]).arg(program);
        c
    }

    /// Moves the calling thread into `node`'s namespace (sockets it opens from now on live
    /// there). Use a thread of its own.
    pub fn enter(&self, node: &str) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open(format!("/var/run/netns/{}", self.ns(node)))?;
        // SAFETY: setns takes a valid namespace file descriptor (kept open for the call) and
        // changes only the calling thread's network namespace.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for node in &self.nodes {
            let _ = ip(&["netns", "del", &self.ns(node)]);
        }
        let _ = ip(&["netns", "del", &self.hub()]);
    }
}
