//! Output formats of the table commands (`models`, `plan`, `sim run`, `sim sweep`, `compare`): `--format table`
//! for people, `csv` and `md` (GitHub Markdown) for the same rows in a spreadsheet or a document, `json` for
//! programs. Each command has one row type; CSV and Markdown columns are its fields in order, and JSON wraps the
//! rows (or a command's richer body) in an envelope naming the schema and its version (docs/formats.md). In
//! every format but `table`, stdout holds only the formatted data: commands print their other lines to stderr.

use clap::ValueEnum;
use serde::Serialize;

/// Output format of table commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned text for a terminal.
    Table,
    /// Comma-separated values with a header row.
    Csv,
    /// A JSON envelope: `{"schema": "pipeshard.<command>", "schema_version": N, …}`.
    Json,
    /// A GitHub-flavoured Markdown table.
    Md,
}

/// Version of every JSON envelope's layout (docs/formats.md): bump it when a field changes meaning or goes
/// away; new fields may appear without a bump.
pub const JSON_SCHEMA_VERSION: u32 = 1;

/// Rows as CSV, the header from the row type's field names.
pub fn csv<T: Serialize>(rows: &[T]) -> anyhow::Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in rows {
        w.serialize(r)?;
    }
    Ok(String::from_utf8(w.into_inner()?)?)
}

/// Rows as a Markdown table (the CSV columns, `|` escaped).
pub fn markdown<T: Serialize>(rows: &[T]) -> anyhow::Result<String> {
    let text = csv(rows)?;
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let cells: Vec<String> = cells.map(|c| c.replace('|', "\\|")).collect();
        format!("| {} |\n", cells.join(" | "))
    };
    let header = r.headers()?.clone();
    let mut out = line(&mut header.iter());
    out += &line(&mut header.iter().map(|_| "---"));
    for rec in r.records() {
        out += &line(&mut rec?.iter());
    }
    Ok(out)
}

/// The JSON envelope of command `schema` around `body` (an object whose fields join the envelope's).
pub fn json(schema: &str, body: serde_json::Value) -> anyhow::Result<String> {
    let mut v =
        serde_json::json!({ "schema": format!("pipeshard.{schema}"), "schema_version": JSON_SCHEMA_VERSION });
    let obj = v.as_object_mut().expect("an object");
    match body {
        serde_json::Value::Object(fields) => obj.extend(fields),
        other => anyhow::bail!("the body of a JSON envelope must be an object, not {other}"),
    }
    Ok(serde_json::to_string_pretty(&v)?)
}

/// `rows` of command `schema` in `format`; `table` renders the human table.
pub fn render<T: Serialize>(
    format: Format,
    schema: &str,
    rows: &[T],
    table: impl FnOnce() -> String,
) -> anyhow::Result<String> {
    Ok(match format {
        Format::Table => table(),
        Format::Csv => csv(rows)?,
        Format::Md => markdown(rows)?,
        Format::Json => json(schema, serde_json::json!({ "rows": rows }))? + "\n",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Row {
        name: &'static str,
        bytes: u64,
        ratio: Option<f64>,
    }

    const ROWS: [Row; 2] =
        [Row { name: "a|b", bytes: 7, ratio: Some(1.5) }, Row { name: "c,d", bytes: 8, ratio: None }];

    #[test]
    fn one_row_type_gives_every_format() {
        assert_eq!(csv(&ROWS).unwrap(), "name,bytes,ratio\na|b,7,1.5\n\"c,d\",8,\n");
        assert_eq!(
            markdown(&ROWS).unwrap(),
            "| name | bytes | ratio |\n| --- | --- | --- |\n| a\\|b | 7 | 1.5 |\n| c,d | 8 |  |\n"
        );
        let v: serde_json::Value =
            serde_json::from_str(&render(Format::Json, "demo", &ROWS, String::new).unwrap()).unwrap();
        assert_eq!(v["schema"], "pipeshard.demo");
        assert_eq!(v["schema_version"], JSON_SCHEMA_VERSION);
        assert_eq!((v["rows"][1]["bytes"].as_u64(), v["rows"][1]["ratio"].is_null()), (Some(8), true));
        assert_eq!(render(Format::Table, "demo", &ROWS, || "t\n".into()).unwrap(), "t\n");
        assert!(json("demo", serde_json::json!([1])).is_err());
    }
}
