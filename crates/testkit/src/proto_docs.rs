//! The reference of the gRPC contracts as Markdown, rendered from the `.proto` comments (the file
//! descriptor set the `proto` crate embeds, which keeps them): every service and method, message
//! and field, enum and value, in the order of the files. `docs/proto.md` is this output;
//! `tests/tests/house/proto_docs.rs` keeps it current.

use std::fmt::Write;

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorProto, FileDescriptorSet, SourceCodeInfo};

/// Path numbers of `FileDescriptorProto` and its children (descriptor.proto).
const MESSAGE_TYPE: i32 = 4;
const ENUM_TYPE: i32 = 5;
const SERVICE: i32 = 6;
const NESTED_TYPE: i32 = 3;
const NESTED_ENUM: i32 = 4;
const FIELD: i32 = 2;
const ENUM_VALUE: i32 = 2;
const METHOD: i32 = 2;

/// Renders the contracts of `descriptor_set` (encoded), whose package starts with one of
/// `packages`.
pub fn render(descriptor_set: &[u8], packages: &[&str]) -> anyhow::Result<String> {
    let set = FileDescriptorSet::decode(descriptor_set)?;
    let mut out = String::from(
        "# gRPC contract reference\n\n\
         Rendered from the comments of `proto/` by `crates/testkit/src/proto_docs.rs`; do not edit by hand \
         (`UPDATE_PROTO_DOCS=1 cargo test -p e2e --test house proto_docs` rewrites it, and the test fails \
         while it is stale).\n",
    );
    for file in set
        .file
        .iter()
        .filter(|f| packages.iter().any(|p| f.package().starts_with(p)))
    {
        render_file(&mut out, file)?;
    }
    Ok(out)
}

fn render_file(out: &mut String, file: &FileDescriptorProto) -> std::fmt::Result {
    let comments = Comments(file.source_code_info.as_ref());
    writeln!(out, "\n## `{}` (`{}`)\n", file.package(), file.name())?;
    for (s, service) in file.service.iter().enumerate() {
        let path = [SERVICE, index(s)];
        writeln!(out, "### service `{}`\n\n{}", service.name(), comments.block(&path))?;
        writeln!(out, "| method | request | response | |\n| --- | --- | --- | --- |")?;
        for (m, method) in service.method.iter().enumerate() {
            let stream = if method.server_streaming() { "stream " } else { "" };
            writeln!(
                out,
                "| `{}` | `{}` | {stream}`{}` | {} |",
                method.name(),
                short(method.input_type()),
                short(method.output_type()),
                comments.cell(&[SERVICE, index(s), METHOD, index(m)])
            )?;
        }
        writeln!(out)?;
    }
    for (m, message) in file.message_type.iter().enumerate() {
        render_message(out, &comments, message, &[MESSAGE_TYPE, index(m)], "")?;
    }
    for (e, enumeration) in file.enum_type.iter().enumerate() {
        render_enum(out, &comments, enumeration, &[ENUM_TYPE, index(e)], "")?;
    }
    Ok(())
}

fn render_message(
    out: &mut String,
    comments: &Comments<'_>,
    message: &DescriptorProto,
    path: &[i32],
    outer: &str,
) -> std::fmt::Result {
    let name = format!("{outer}{}", message.name());
    if message.options.as_ref().is_some_and(|o| o.map_entry()) {
        return Ok(());
    }
    writeln!(out, "### message `{name}`\n\n{}", comments.block(path))?;
    if !message.field.is_empty() {
        writeln!(out, "| field | type | number | |\n| --- | --- | --- | --- |")?;
        for (f, field) in message.field.iter().enumerate() {
            let mut field_path = path.to_vec();
            field_path.extend([FIELD, index(f)]);
            let oneof = field
                .oneof_index
                .filter(|_| !field.proto3_optional())
                .and_then(|i| message.oneof_decl.get(usize::try_from(i).ok()?))
                .map(|o| format!(" (one of `{}`)", o.name()))
                .unwrap_or_default();
            writeln!(
                out,
                "| `{}` | {} | {} | {}{oneof} |",
                field.name(),
                field_type(message, field),
                field.number(),
                comments.cell(&field_path)
            )?;
        }
        writeln!(out)?;
    }
    for (n, nested) in message.nested_type.iter().enumerate() {
        let mut nested_path = path.to_vec();
        nested_path.extend([NESTED_TYPE, index(n)]);
        render_message(out, comments, nested, &nested_path, &format!("{name}."))?;
    }
    for (e, enumeration) in message.enum_type.iter().enumerate() {
        let mut enum_path = path.to_vec();
        enum_path.extend([NESTED_ENUM, index(e)]);
        render_enum(out, comments, enumeration, &enum_path, &format!("{name}."))?;
    }
    Ok(())
}

fn render_enum(
    out: &mut String,
    comments: &Comments<'_>,
    enumeration: &EnumDescriptorProto,
    path: &[i32],
    outer: &str,
) -> std::fmt::Result {
    writeln!(
        out,
        "### enum `{outer}{}`\n\n{}",
        enumeration.name(),
        comments.block(path)
    )?;
    writeln!(out, "| value | number | |\n| --- | --- | --- |")?;
    for (v, value) in enumeration.value.iter().enumerate() {
        let mut value_path = path.to_vec();
        value_path.extend([ENUM_VALUE, index(v)]);
        writeln!(
            out,
            "| `{}` | {} | {} |",
            value.name(),
            value.number(),
            comments.cell(&value_path)
        )?;
    }
    writeln!(out)
}

/// A field's type as written in the .proto: `repeated`, `optional`, `map<K, V>`, scalar or
/// message name.
fn field_type(message: &DescriptorProto, field: &prost_types::FieldDescriptorProto) -> String {
    let named = |field: &prost_types::FieldDescriptorProto| match field.r#type() {
        Type::Message | Type::Enum => format!("`{}`", short(field.type_name())),
        scalar => format!("`{}`", scalar.as_str_name().trim_start_matches("TYPE_").to_lowercase()),
    };
    let entry = message.nested_type.iter().find(|n| {
        n.options.as_ref().is_some_and(|o| o.map_entry()) && field.type_name().ends_with(&format!(".{}", n.name()))
    });
    if let Some(entry) = entry
        && let [key, value] = entry.field.as_slice()
    {
        return format!("map<{}, {}>", named(key), named(value));
    }
    match field.label() {
        Label::Repeated => format!("repeated {}", named(field)),
        _ if field.proto3_optional() => format!("optional {}", named(field)),
        _ => named(field),
    }
}

/// `.orchestrator.v1.RunResult` → `RunResult` (the reference is per package).
fn short(type_name: &str) -> &str {
    type_name.rsplit('.').next().unwrap_or(type_name)
}

fn index(i: usize) -> i32 {
    i32::try_from(i).unwrap_or(i32::MAX)
}

/// The leading comments of the file's elements, by path.
struct Comments<'a>(Option<&'a SourceCodeInfo>);

impl Comments<'_> {
    fn leading(&self, path: &[i32]) -> String {
        self.0
            .and_then(|info| info.location.iter().find(|l| l.path == path))
            .map(|l| l.leading_comments().trim().to_owned())
            .unwrap_or_default()
    }

    /// The comment as paragraphs (comment lines joined, blank lines kept).
    fn block(&self, path: &[i32]) -> String {
        let text = self.leading(path);
        if text.is_empty() {
            return String::new();
        }
        let paragraphs: Vec<String> = text
            .split("\n\n")
            .map(|p| p.lines().map(str::trim).collect::<Vec<_>>().join(" "))
            .collect();
        format!("{}\n", paragraphs.join("\n\n"))
    }

    /// The comment on one line, safe in a table cell.
    fn cell(&self, path: &[i32]) -> String {
        self.leading(path)
            .lines()
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" ")
            .replace('|', "\\|")
    }
}
