"""Tool calling at the edge: the request's tools (`request`, `schema`), how they are shown
to the model (`render`), the grammar that constrains a call (`grammar`) and the parser
that reads calls back out of the text (`parse`, `mistral`, `json_scan`)."""
