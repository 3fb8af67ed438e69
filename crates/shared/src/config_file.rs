//! A service's optional TOML settings file (`--config FILE`, or its environment variable): a flat
//! table whose keys are the long flag names of `serve` (`max-turns = 16`,
//! `tool-runner = ["dns:///tool-runner:50052"]`; `_` may stand for `-`). The file becomes
//! command-line arguments before clap parses, so every value goes through its flag's own parser,
//! bounds and error message. Precedence: a flag, then its environment variable, then the file,
//! then the default. Unknown keys are errors (a misspelt setting is never ignored).
//!
//! A renamed flag keeps its old name for one release ([`Renamed`], the flag's hidden clap
//! `alias`): on the command line, as a key of the file and as its old environment variable, each
//! use said in a warning ([`with_renamed_flags`]).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The largest settings file read.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// A flag renamed: its old name and environment variable still work, with a warning, until the
/// next release drops them.
#[derive(Debug, Clone, Copy)]
pub struct Renamed {
    /// The old long name, without `--` (also the flag's hidden clap `alias`).
    pub old: &'static str,
    /// The new long name.
    pub new: &'static str,
    /// The old environment variable.
    pub old_env: &'static str,
    /// The new environment variable.
    pub new_env: &'static str,
}

/// `argv` with the old names of `renamed` flags given for `serve` turned into the new ones: a
/// flag on the command line (or added from the settings file), or an old environment variable
/// when neither the new one nor the flag is set (its value becomes the flag, below any flag
/// given). One warning per old name used, for the caller to print.
pub fn with_renamed_flags(
    command: &clap::Command,
    argv: Vec<OsString>,
    renamed: &[Renamed],
) -> (Vec<OsString>, Vec<String>) {
    let Some(start) = serve_position(command, &argv) else {
        return (argv, Vec::new());
    };
    let mut argv = argv;
    let mut warnings = Vec::new();
    for rename in renamed {
        let (old, new) = (format!("--{}", rename.old), format!("--{}", rename.new));
        let mut used = false;
        for arg in &mut argv[start..] {
            let Some(text) = arg.to_str() else { continue };
            if text == old || text.starts_with(&format!("{old}=")) {
                *arg = format!("{new}{}", &text[old.len()..]).into();
                used = true;
            }
        }
        if used {
            warnings.push(format!("{old} is renamed {new}; the old name goes in the next release"));
        }
        let given = argv[start..].iter().any(|a| {
            a.to_str()
                .is_some_and(|a| a == new || a.starts_with(&format!("{new}=")))
        });
        if let Some(value) = std::env::var_os(rename.old_env).filter(|_| std::env::var_os(rename.new_env).is_none()) {
            warnings.push(format!(
                "{} is renamed {}; the old name goes in the next release",
                rename.old_env, rename.new_env
            ));
            if !given {
                let mut flag = OsString::from(format!("{new}="));
                flag.push(value);
                argv.push(flag);
            }
        }
    }
    (argv, warnings)
}

/// How one flag takes its values.
struct Flag {
    long: String,
    /// Its other names (a renamed flag's old one), which a key of the file may use too.
    aliases: Vec<String>,
    env: Option<OsString>,
    /// A switch (`--flag`, no value).
    switch: bool,
    /// It may be given more than once.
    repeatable: bool,
}

/// `argv` with the settings of the file that `--config` (or `env_var`) names added for `serve`
/// (the default subcommand); unchanged when there is no file or another subcommand runs. The
/// error names the file and what is wrong.
pub fn with_settings_file(
    command: &clap::Command,
    argv: Vec<OsString>,
    env_var: &str,
) -> Result<Vec<OsString>, String> {
    let Some(insert_at) = serve_position(command, &argv) else {
        return Ok(argv);
    };
    let Some(path) = config_path(&argv, env_var) else {
        return Ok(argv);
    };
    let serve = command
        .get_subcommands()
        .find(|c| c.get_name() == "serve")
        .ok_or("the command has no serve subcommand")?;
    let flags: Vec<Flag> = serve.get_arguments().filter_map(flag).collect();
    let table = read(&path)?;
    let mut added = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let flag = flags
            .iter()
            .find(|f| (f.long == long || f.aliases.contains(&long)) && f.long != "config")
            .ok_or_else(|| {
                format!(
                    "{}: unknown setting {key:?}; the keys are the long flags of `serve` (see --help)",
                    path.display()
                )
            })?;
        let on_command_line = std::iter::once(&flag.long).chain(&flag.aliases).any(|name| {
            argv[insert_at..].iter().any(|a| {
                a.to_str()
                    .is_some_and(|a| a == format!("--{name}") || a.starts_with(&format!("--{name}=")))
            })
        });
        let in_environment = flag.env.as_ref().is_some_and(|env| std::env::var_os(env).is_some());
        if on_command_line || in_environment {
            continue;
        }
        added.extend(arguments(flag, &long, value).map_err(|e| format!("{}: {key}: {e}", path.display()))?);
    }
    let mut argv = argv;
    argv.splice(insert_at..insert_at, added);
    Ok(argv)
}

/// Where `serve`'s flags start in `argv` (after the program, and after `serve` when it is named);
/// `None` when another subcommand runs.
fn serve_position(command: &clap::Command, argv: &[OsString]) -> Option<usize> {
    match argv.get(1).and_then(|a| a.to_str()) {
        Some("serve") => Some(2),
        Some(first) if !first.starts_with('-') && command.find_subcommand(first).is_some() => None,
        _ => Some(1),
    }
}

/// The file named by `--config FILE` / `--config=FILE`, else by `env_var`.
fn config_path(argv: &[OsString], env_var: &str) -> Option<PathBuf> {
    let mut args = argv.iter().skip(1);
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str() else { continue };
        if text == "--config" {
            return args.next().map(PathBuf::from);
        }
        if let Some(path) = text.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    std::env::var_os(env_var).filter(|v| !v.is_empty()).map(PathBuf::from)
}

fn flag(arg: &clap::Arg) -> Option<Flag> {
    let long = arg.get_long()?.to_owned();
    let switch = matches!(arg.get_action(), clap::ArgAction::SetTrue);
    let repeatable = matches!(arg.get_action(), clap::ArgAction::Append);
    Some(Flag {
        long,
        aliases: arg
            .get_all_aliases()
            .unwrap_or_default()
            .into_iter()
            .map(str::to_owned)
            .collect(),
        env: arg.get_env().map(OsString::from),
        switch,
        repeatable,
    })
}

fn read(path: &Path) -> Result<toml::Table, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("--config {shown}: {e}"))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!("--config {shown}: larger than {MAX_FILE_BYTES} bytes"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("--config {shown}: {e}"))?;
    text.parse::<toml::Table>()
        .map_err(|e| format!("--config {shown}: not a TOML table of settings: {e}"))
}

/// The arguments one setting stands for, under the name the file gave it (`long`).
fn arguments(flag: &Flag, long: &str, value: &toml::Value) -> Result<Vec<OsString>, String> {
    match value {
        toml::Value::Boolean(on) if flag.switch => Ok(if *on {
            vec![format!("--{long}").into()]
        } else {
            Vec::new()
        }),
        _ if flag.switch => Err("is a switch: true or false".into()),
        toml::Value::Array(items) if flag.repeatable => items
            .iter()
            .map(|item| scalar(item).map(|v| format!("--{long}={v}").into()))
            .collect(),
        toml::Value::Array(_) => Err("takes one value, not a list".into()),
        other => Ok(vec![format!("--{long}={}", scalar(other)?).into()]),
    }
}

fn scalar(value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(n) => Ok(n.to_string()),
        toml::Value::Float(x) => Ok(x.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err("must be a string, a number or a boolean".into()),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use clap::{CommandFactory, Parser, Subcommand};

    use super::*;

    #[derive(Debug, Clone, clap::Args)]
    struct Serve {
        #[arg(long, env = "SHARED_CONFIG_TEST_CONFIG")]
        config: Option<PathBuf>,
        #[arg(long, env = "SHARED_CONFIG_TEST_MAX_TURNS", default_value_t = 16)]
        max_turns: u32,
        #[arg(long = "tool-runner", value_delimiter = ',')]
        endpoints: Vec<String>,
        #[arg(long)]
        verbose: bool,
        #[arg(long, default_value = "a")]
        name: String,
        #[arg(long, alias = "old-grace", env = "SHARED_CONFIG_TEST_NEW_GRACE", default_value = "1")]
        new_grace: u32,
    }

    const RENAMED: &[Renamed] = &[Renamed {
        old: "old-grace",
        new: "new-grace",
        old_env: "SHARED_CONFIG_TEST_OLD_GRACE",
        new_env: "SHARED_CONFIG_TEST_NEW_GRACE",
    }];

    #[derive(Debug, Subcommand)]
    enum Sub {
        Serve(Serve),
        Call {
            #[arg(long)]
            prompt: String,
        },
    }

    #[derive(Debug, Parser)]
    #[command(args_conflicts_with_subcommands = true)]
    struct Cli {
        #[command(subcommand)]
        command: Option<Sub>,
        #[command(flatten)]
        serve: Serve,
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn parse(args: &[&str]) -> Result<Serve, String> {
        parse_warned(args).map(|(serve, _)| serve)
    }

    fn parse_warned(args: &[&str]) -> Result<(Serve, Vec<String>), String> {
        let argv = args.iter().map(OsString::from).collect();
        let argv = with_settings_file(&Cli::command(), argv, "SHARED_CONFIG_TEST_UNSET")?;
        let (argv, warnings) = with_renamed_flags(&Cli::command(), argv, RENAMED);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        let serve = match cli.command {
            Some(Sub::Serve(serve)) => serve,
            _ => cli.serve,
        };
        Ok((serve, warnings))
    }

    #[test]
    fn a_renamed_flag_keeps_its_old_name_with_a_warning() {
        let (serve, warnings) = parse_warned(&["svc", "--old-grace", "7"]).unwrap();
        assert_eq!(serve.new_grace, 7);
        assert_eq!(
            warnings,
            ["--old-grace is renamed --new-grace; the old name goes in the next release"]
        );
        let (serve, warnings) = parse_warned(&["svc", "serve", "--old-grace=8"]).unwrap();
        assert_eq!((serve.new_grace, warnings.len()), (8, 1));
        // The new name says nothing; a key of the file under the old name is taken and said.
        let (serve, warnings) = parse_warned(&["svc", "--new-grace", "9"]).unwrap();
        assert_eq!((serve.new_grace, warnings.len()), (9, 0));
        let f = file("old-grace = 5\n");
        let (serve, warnings) = parse_warned(&["svc", "--config", f.path().to_str().unwrap()]).unwrap();
        assert_eq!((serve.new_grace, warnings.len()), (5, 1));
        // A flag under either name wins over the file.
        let (serve, _) = parse_warned(&["svc", "--config", f.path().to_str().unwrap(), "--old-grace", "4"]).unwrap();
        assert_eq!(serve.new_grace, 4);
    }

    #[test]
    fn another_subcommand_keeps_its_arguments() {
        let (argv, warnings) = with_renamed_flags(
            &Cli::command(),
            ["svc", "call", "--prompt", "--old-grace"].map(OsString::from).to_vec(),
            RENAMED,
        );
        assert_eq!(argv[3], "--old-grace");
        assert!(warnings.is_empty());
    }

    #[test]
    fn the_file_fills_what_flags_leave_and_flags_win() {
        let f = file(
            "max_turns = 20\ntool-runner = [\"http://a:1\", \"http://b:2\"]\nverbose = true\nname = \"from-file\"\n",
        );
        let path = f.path().to_str().unwrap();
        let serve = parse(&["svc", "--config", path]).unwrap();
        assert_eq!(serve.max_turns, 20);
        assert_eq!(serve.endpoints, ["http://a:1", "http://b:2"]);
        assert!(serve.verbose);
        assert_eq!(serve.name, "from-file");
        // The same under `serve`, with flags that win over the file.
        let serve = parse(&[
            "svc",
            "serve",
            &format!("--config={path}"),
            "--max-turns",
            "3",
            "--tool-runner=http://c:3",
        ])
        .unwrap();
        assert_eq!((serve.max_turns, serve.endpoints), (3, vec!["http://c:3".to_owned()]));
        // Another subcommand is left alone.
        assert!(parse(&["svc", "call", "--prompt", "x"]).is_ok());
    }

    #[test]
    fn bad_settings_are_errors_naming_the_file_and_key() {
        let cases = [
            ("max-turn = 3\n", "unknown setting \"max-turn\""),
            ("verbose = \"yes\"\n", "verbose: is a switch"),
            ("name = [\"a\", \"b\"]\n", "name: takes one value"),
            ("name = { a = 1 }\n", "name: must be a string"),
            ("config = \"other.toml\"\n", "unknown setting \"config\""),
            ("not toml", "not a TOML table"),
        ];
        for (text, expected) in cases {
            let f = file(text);
            let error = parse(&["svc", "--config", f.path().to_str().unwrap()]).unwrap_err();
            assert!(error.contains(expected), "{text:?}: {error}");
            assert!(error.contains(&f.path().display().to_string()), "{error}");
        }
        // A value the flag's own parser refuses gets clap's message.
        let f = file("max-turns = -1\n");
        let error = parse(&["svc", "--config", f.path().to_str().unwrap()]).unwrap_err();
        assert!(error.contains("--max-turns"), "{error}");
        let error = parse(&["svc", "--config", "/nonexistent/settings.toml"]).unwrap_err();
        assert!(error.contains("/nonexistent/settings.toml"), "{error}");
    }

    #[test]
    fn the_file_size_is_bounded_on_both_sides() {
        let pad = |len: usize| format!("name = \"x\"\n{}", "#".repeat(len - 11));
        let at_cap = file(&pad(MAX_FILE_BYTES as usize));
        assert!(parse(&["svc", "--config", at_cap.path().to_str().unwrap()]).is_ok());
        let over = file(&pad(MAX_FILE_BYTES as usize + 1));
        let error = parse(&["svc", "--config", over.path().to_str().unwrap()]).unwrap_err();
        assert!(error.contains("larger than"), "{error}");
    }
}
