//! Tests of the CLI: every flag has its `MOELANE_*` variable, parsing and precedence.
use super::*;
use clap::CommandFactory;
use std::collections::{BTreeMap, BTreeSet};

/// Tests that read or set `MOELANE_*` variables hold this (the environment is the process's).
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// (command path, long flag, env var) of every argument, `bench` left out.
fn args() -> Vec<(String, String, Option<String>, bool)> {
    fn walk(c: &clap::Command, path: &str, out: &mut Vec<(String, String, Option<String>, bool)>) {
        for a in c.get_arguments() {
            let Some(long) = a.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            let env = a.get_env().map(|e| e.to_string_lossy().to_string());
            out.push((path.into(), long.into(), env, a.is_hide_set()));
        }
        for s in c.get_subcommands() {
            if s.get_name() != "bench" {
                walk(s, &format!("{path} {}", s.get_name()), out);
            }
        }
    }
    let mut out = Vec::new();
    let mut c = Cli::command();
    c.build();
    walk(&c, "moelane", &mut out);
    out
}

#[test]
fn every_flag_has_one_moelane_env_var_and_one_meaning() {
    let all = args();
    assert!(
        all.len() > 40,
        "{} flags: the walk missed commands",
        all.len()
    );
    let mut flags_of_env: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (cmd, long, env, hidden) in &all {
        if *hidden {
            continue; // refusals of old spellings: nothing to set
        }
        let env = env
            .as_ref()
            .unwrap_or_else(|| panic!("{cmd} --{long} has no environment variable"));
        assert!(env.starts_with("MOELANE_"), "{cmd} --{long}: {env}");
        flags_of_env
            .entry(env.clone())
            .or_default()
            .insert(long.clone());
    }
    for (env, flags) in &flags_of_env {
        assert_eq!(flags.len(), 1, "{env} sets several flags: {flags:?}");
    }
    // a flag that serve and lane both take reads the same variable in both
    let of = |cmd: &str| -> BTreeMap<String, Option<String>> {
        all.iter()
            .filter(|a| a.0 == cmd && !a.3)
            .map(|a| (a.1.clone(), a.2.clone()))
            .collect()
    };
    let (serve, lane) = (of("moelane serve"), of("moelane lane"));
    for (long, env) in &serve {
        if let Some(e) = lane.get(long) {
            assert_eq!(e, env, "--{long}");
        }
    }
    // the device flags have one name each, in both commands; --max-running in both
    for f in [
        "primary-device",
        "sidecar-device",
        "max-running",
        "max-step-tokens",
        "kv-tokens",
    ] {
        assert!(serve.contains_key(f) && lane.contains_key(f), "--{f}");
    }
}

fn parse(argv: &[&str]) -> std::result::Result<(Cli, clap::ArgMatches), clap::Error> {
    use clap::FromArgMatches;
    let m = Cli::command().try_get_matches_from(argv)?;
    Ok((Cli::from_arg_matches(&m)?, m))
}

fn lane(argv: &[&str]) -> (LaneArgs, clap::ArgMatches) {
    let mut v = vec!["moelane", "lane"];
    v.extend(argv);
    let (cli, m) = parse(&v).unwrap();
    let Cmd::Lane(a) = cli.cmd else {
        panic!("not lane")
    };
    (*a, m.subcommand_matches("lane").unwrap().clone())
}

#[test]
fn devices_are_cpu_or_cuda_n_only() {
    assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
    for bad in [
        "gpu0", "cuda", "cuda:", "cuda:x", "cuda:+1", "CPU", "cuda:0 ", "",
    ] {
        assert!(bad.parse::<Device>().is_err(), "{bad:?}");
    }
    let c = "cuda:3".parse::<Device>();
    if cfg!(feature = "cuda") {
        assert_eq!(c, Ok(Device::Cuda(3)));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    } else {
        assert!(c.unwrap_err().contains("without CUDA"));
    }
    // the help lists what is accepted
    let mut cmd = Cli::command();
    let help = cmd
        .find_subcommand_mut("serve")
        .unwrap()
        .render_long_help()
        .to_string();
    assert!(help.contains("--primary-device <cpu|cuda:N>"), "{help}");
}

#[test]
fn device_means_the_sidecar_in_lane_and_is_refused_by_serve() {
    let _g = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let (a, _) = lane(&["--role", "primary", "--device", "cpu"]);
    assert_eq!(
        (a.sidecar_device, a.primary_device),
        (Some(Device::Cpu), None)
    );
    let (a, _) = lane(&["--primary-device", "cpu", "--sidecar-device", "cpu"]);
    assert_eq!(a.primary_device, Some(Device::Cpu));
    let e = parse(&["moelane", "serve", "--device", "cpu"])
        .err()
        .unwrap();
    assert!(e.to_string().contains("--primary-device"), "{e}");
    let (cli, _) = parse(&["moelane", "serve", "--primary-device", "cpu"]).unwrap();
    assert!(matches!(
        cli.cmd,
        Cmd::Serve {
            primary_device: Device::Cpu,
            sidecar_device: Device::Cpu,
            ..
        }
    ));
}

#[test]
fn roles_and_links_are_enums() {
    let _g = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let (a, _) = lane(&["--role", "sidecar", "--link", "shm"]);
    assert_eq!((a.role, a.link), (Some(Role::Sidecar), Some(Link::Shm)));
    for bad in [["--role", "primry"], ["--link", "udp"]] {
        let mut v = vec!["moelane", "lane"];
        v.extend(bad);
        let e = parse(&v).err().unwrap();
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue, "{bad:?}");
    }
}

#[test]
fn environment_sets_flags_and_the_command_line_wins() {
    let _g = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let vars = [
        ("MOELANE_ROLE", "primary"),
        ("MOELANE_MAX_RUNNING", "7"),
        ("MOELANE_KV_TOKENS", "4096"),
        ("MOELANE_LANE", "http://a:1,http://b:2"),
        ("MOELANE_SIDECAR_DEVICE", "cpu"),
        ("MOELANE_ADAPTIVE", "1"),
        ("MOELANE_MARGIN", "0.5"),
        ("MOELANE_LINK", "shm"),
    ];
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let got = std::panic::catch_unwind(|| {
        let (a, m) = lane(&["--kv-tokens", "8192"]);
        assert_eq!(a.role, Some(Role::Primary));
        assert_eq!(a.max_running, Some(7));
        assert_eq!(a.kv_tokens, Some(8192), "the flag wins");
        assert_eq!(a.lane, ["http://a:1", "http://b:2"]);
        assert_eq!(a.sidecar_device, Some(Device::Cpu));
        assert_eq!(a.link, Some(Link::Shm));
        assert!(a.residency.adaptive);
        assert_eq!(a.residency.margin, 0.5);
        // a config file fills only what neither gave
        let dir = std::env::temp_dir().join(format!("moelane-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("lane.toml");
        std::fs::write(
            &f,
            "role = \"sidecar\"\nmax-running = 9\nmax-step-tokens = 32\nshm-bytes = 4096\n\
             device = \"cpu\"\n\
             [residency]\nmargin = 0.75\nspare-slots = 3\n",
        )
        .unwrap();
        let (a, m2) = lane(&["--config", f.to_str().unwrap()]);
        let a = a.merged(Some(&m2)).unwrap();
        assert_eq!(
            a.role,
            Some(Role::Primary),
            "the environment beats the file"
        );
        assert_eq!(a.max_running, Some(7));
        assert_eq!(a.shm_bytes, Some(4096), "the file fills the rest");
        assert_eq!(a.max_step_tokens, Some(32));
        assert_eq!(a.residency.margin, 0.5);
        assert_eq!(a.residency.spare_slots, 3);
        let _ = std::fs::remove_dir_all(&dir);
        drop(m);
        // serve reads the same variables
        let (cli, _) = parse(&["moelane", "serve"]).unwrap();
        let Cmd::Serve {
            max_running,
            kv_tokens,
            residency,
            ..
        } = cli.cmd
        else {
            panic!("not serve")
        };
        assert_eq!((max_running, kv_tokens), (7, 4096));
        assert!(residency.adaptive);
        // a bad value names the flag
        std::env::set_var("MOELANE_MAX_RUNNING", "many");
        let e = parse(&["moelane", "serve"]).err().unwrap().to_string();
        assert!(e.contains("--max-running"), "{e}");
    });
    for (k, _) in vars {
        std::env::remove_var(k);
    }
    got.unwrap();
}

#[test]
fn an_error_is_one_line_with_each_cause_once() {
    let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
    let e = anyhow::Error::new(io)
        .context("reading x: gone")
        .context("starting");
    assert_eq!(one_line(&e), "starting: reading x: gone");
    let e = anyhow::anyhow!("two\nlines");
    assert_eq!(one_line(&e), "two lines");
}

#[test]
fn runtime_threads_follow_the_flag_or_the_machine() {
    assert_eq!(runtime_threads(3), 3);
    assert!((2..=8).contains(&runtime_threads(0)));
}

#[test]
fn budgets_parse_from_flags_and_toml() {
    let (a, _) = lane(&["--role", "primary", "--primary-memory", "1.5GiB"]);
    assert_eq!(a.primary_memory, Some(Size(3 << 29)));
    assert!(parse(&["moelane", "lane", "--primary-memory", "12XB"]).is_err());
    assert!(parse(&[
        "moelane",
        "serve",
        "--hot-experts",
        "4",
        "--primary-memory",
        "1G"
    ])
    .is_err());
    for (text, want) in [
        ("primary-memory = 80000000000", Some(Size(80_000_000_000))),
        ("primary-memory = \"80GiB\"", Some(Size(80 << 30))),
    ] {
        let a: LaneArgs = toml::from_str(text).unwrap();
        assert_eq!(a.primary_memory, want, "{text}");
    }
    assert!(toml::from_str::<LaneArgs>("primary-memory = 0").is_err());
    assert!(toml::from_str::<LaneArgs>("primary-memory = \"lots\"").is_err());
    let a: LaneArgs = toml::from_str("hot-experts = 32").unwrap();
    assert_eq!(a.hot_experts, Some(32));
}
